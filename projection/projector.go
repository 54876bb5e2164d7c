package projection

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/internal/lograte"
	"github.com/verity-go/verity/outbox"
)

// Defaults of Config.
const (
	// PrefixDefault is the default Config.Prefix.
	PrefixDefault = "verity:"
	// VersionBucketsDefault is the default Config.VersionBuckets: one
	// version hash per collection.
	VersionBucketsDefault = 0
	// MaxValueBytesDefault is the default Config.MaxValueBytes: Redis's
	// default proto-max-bulk-len, which is also its largest string.
	MaxValueBytesDefault = 512 << 20
)

// Config configures a RedisProjector.
type Config struct {
	// Prefix starts every key the projector writes (see Keyspace). It must
	// not contain '{' or '}'. Defaults to PrefixDefault ("verity:").
	Prefix string
	// VersionBuckets spreads each collection's member versions over this
	// many small hashes instead of one (see Keyspace, "Version buckets"):
	// Redis keeps a hash of at most 128 short entries as a listpack, which
	// cuts the versions' memory from about 58 to about 20 bytes per member.
	// Use about expected members per collection / 64 (so buckets stay
	// under 128 entries as the collection doubles), at most
	// VersionBucketsMax. Every projector, reconciler and reader of a
	// collection must use the same count; the gate refuses a mismatch with
	// *LayoutMismatchError, and reconcile's Rebuild migrates a collection
	// to a new count. Defaults to 0: one version hash per collection.
	VersionBuckets int
	// MaxValueBytes bounds a write's value (a hash field's or document's
	// bytes), its member, and the keys its collection or document name
	// makes (escaped, with the prefix and suffixes). Redis refuses a
	// larger bulk string by closing the connection, which would fail every
	// write of the record's script call; a larger one fails its own record
	// instead (*MapError wrapping *InvalidTargetError), so Handle
	// dead-letters it alone. Set it to the server's proto-max-bulk-len if
	// that was lowered. Defaults to MaxValueBytesDefault.
	MaxValueBytes int
	// Logger receives a debug line per batch, and a warning for a batch
	// with an OutcomeConflict (one a second at most, per projector).
	// Defaults to a logger that discards everything.
	Logger *slog.Logger
	// MeterProvider receives the projector's metrics (verity.projection.*,
	// see the README's metrics table): the gate's verdicts (applied,
	// duplicate, stale, conflict), records that failed, the gate's
	// round-trip time and the commit-to-visible lag of applied records.
	// Defaults to nil (left nil by WithDefaults): nothing is recorded.
	MeterProvider metric.MeterProvider
}

// WithDefaults returns a copy of c (or of the zero Config when c is nil)
// with every unset field set to its default.
func (c *Config) WithDefaults() *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	if out.Prefix == "" {
		out.Prefix = PrefixDefault
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	if out.MaxValueBytes == 0 {
		out.MaxValueBytes = MaxValueBytesDefault
	}
	return &out
}

func (c *Config) validate() error {
	if _, err := NewKeyspace(c.Prefix); err != nil {
		return &ConfigError{Field: "Config.Prefix", Reason: fmt.Sprintf("%q must not contain '{' or '}' (it would become the Redis Cluster hash tag); choose a prefix such as %q", c.Prefix, PrefixDefault)}
	}
	if c.MaxValueBytes < 0 {
		return &ConfigError{Field: "Config.MaxValueBytes", Reason: fmt.Sprintf("is %d; use a positive size, or zero for the default (%d)", c.MaxValueBytes, MaxValueBytesDefault)}
	}
	return validateBuckets("Config.VersionBuckets", c.VersionBuckets)
}

// RedisProjector projects outbox records into Redis through a Gate. It maps
// each record with the caller's Mapper and applies the whole batch with one
// script call per Redis Cluster slot. It implements Projector and
// outbox.Handler, so it can be given directly to outbox.NewRelay. It is safe
// for concurrent use. Create it with NewRedisProjector: the zero value
// refuses every call with *ConfigError.
type RedisProjector struct {
	gate     *Gate
	maxValue int
	mapper   Mapper
	logger   *slog.Logger
	metrics  *projectionMetrics // nil: no MeterProvider
	// conflicts limits the warnings about OutcomeConflict to one line a
	// second: a source that reuses versions may do so for many records.
	conflicts lograte.Limiter
}

var (
	_ Projector      = (*RedisProjector)(nil)
	_ outbox.Handler = (*RedisProjector)(nil)
)

// NewRedisProjector returns a projector writing through client (single
// node, Sentinel or Cluster) the writes that mapper derives from records.
// cfg may be nil for the defaults. A StreamMapper with a nil entry (typed
// nils included, such as a nil MapperFunc), or whose DocumentMapper
// namespaces could name the same document (one a prefix of another, see
// DocumentMapper), is refused with *ConfigError; so are such entries
// reached through StreamMappers nested in it.
//
// client must bound how long it waits for Redis. go-redis ends a command
// in flight only at its connection's deadline, which comes from
// ReadTimeout and WriteTimeout and, with ContextTimeoutEnabled, from the
// context's deadline; cancelling the context does not end it. So a
// *redis.Client, *redis.ClusterClient or *redis.Ring is refused with
// *ConfigError when its ReadTimeout or WriteTimeout is -2, which makes
// go-redis set no deadline at all (not even the context's), or is -1 (no
// timeout) while ContextTimeoutEnabled is false. Once a relay's context
// is cancelled, Run therefore waits for a batch stuck in Redis at most its
// ShutdownTimeout plus the client's ReadTimeout for the command in flight
// (go-redis's default: 5s), and its WriteTimeout on top if Redis stalls
// while the command is still being sent; with ContextTimeoutEnabled and
// the timeouts -1, until the Handler context's deadline instead, which
// the relay sets to the end of the claim's lease (RelayConfig.LeaseDuration,
// counted from just before the claim was sent). A Ring is checked on its
// RingOptions, which go-redis gives every shard, up or down; with a
// RingOptions.NewClient function of the caller's, on the clients it made
// for the shards that are up when NewRedisProjector is called. Not
// checked: other client types, and the node clients a
// ClusterOptions.NewClient function makes.
func NewRedisProjector(client redis.UniversalClient, mapper Mapper, cfg *Config) (*RedisProjector, error) {
	if deps.Missing(client) {
		return nil, &ConfigError{Field: "client", Reason: "is nil; pass a redis.UniversalClient"}
	}
	if err := checkTimeouts(client); err != nil {
		return nil, err
	}
	if deps.Missing(mapper) {
		return nil, &ConfigError{Field: "mapper", Reason: "is nil; pass a Mapper such as SortedSetMapper(\"board\")"}
	}
	if err := checkStreams(mapper); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	ks, err := NewKeyspace(cfg.Prefix)
	if err == nil {
		ks, err = ks.WithVersionBuckets(cfg.VersionBuckets)
	}
	if err != nil {
		return nil, err
	}
	metrics, err := newProjectionMetrics(cfg.MeterProvider, ks.Prefix())
	if err != nil {
		return nil, fmt.Errorf("projection: NewRedisProjector: %w", err)
	}
	gate := NewGate(client, ks)
	gate.metrics = metrics
	return &RedisProjector{gate: gate, maxValue: cfg.MaxValueBytes, mapper: mapper, logger: cfg.Logger, metrics: metrics}, nil
}

// checkTimeouts refuses a client that can wait for Redis forever (see
// NewRedisProjector): without a deadline, a Redis that stops answering
// holds Handle, and the relay's shutdown with it.
func checkTimeouts(client redis.UniversalClient) error {
	if u := deps.UnboundedRedis(client); u != nil {
		return &ConfigError{Field: u.Field, Reason: u.Reason}
	}
	return nil
}

// Gate returns the projector's gate, for writes that do not come from the
// outbox (reconciliation repairs). It is nil for a RedisProjector not made
// by NewRedisProjector; a nil *Gate refuses every call with *ConfigError.
func (p *RedisProjector) Gate() *Gate {
	if p.unmade() {
		return nil
	}
	return p.gate
}

// Keyspace returns the keys the projector writes, for readers: the zero
// Keyspace for a RedisProjector not made by NewRedisProjector.
func (p *RedisProjector) Keyspace() Keyspace {
	if p.unmade() {
		return Keyspace{}
	}
	return p.gate.ks
}

// unmade reports a RedisProjector that was not made by NewRedisProjector
// (the zero value, or nil), whose methods refuse every call instead of
// panicking on its nil fields.
func (p *RedisProjector) unmade() bool {
	return p == nil || p.gate == nil || p.mapper == nil || p.logger == nil
}

// unmadeProjector refuses a call on a RedisProjector that unmade reports.
func unmadeProjector() error {
	return &ConfigError{Field: "client", Reason: "is nil: the RedisProjector has no Redis client; create it with NewRedisProjector(client, mapper, cfg)"}
}

// Project maps and gates batch and returns one Outcome per record.
//
// Records are validated before anything is written: a record that its
// Mapper rejects, or whose Write is invalid, fails the whole call with a
// *MapError (wrapping the Mapper's error or the typed validation error) and
// nothing is written. Records whose stored version is unreadable get
// OutcomeUnknown and make the returned error non-nil (ErrCorruptVersion)
// while the other outcomes stay valid. A collection whose version layout
// differs fails the call with *LayoutMismatchError (as Gate.Apply). Any
// other error leaves the batch's effect unknown; projecting it again is
// safe. When one slot group's script call fails (or is refused for its
// layout), the call returns that error and no outcomes, but the metrics
// still count the verdicts, and the lag, of the slot groups whose calls
// succeeded, and count only the failed group's records as failed.
func (p *RedisProjector) Project(ctx context.Context, batch []outbox.Record) ([]Outcome, error) {
	if p.unmade() {
		return nil, unmadeProjector()
	}
	writes := make([]Write, len(batch))
	var firstErr error
	unmapped := 0
	for i := range batch {
		w, err := p.mapRecord(i, batch[i])
		if err != nil {
			// Keep mapping: the metric counts every refused record, as
			// Handle does.
			unmapped++
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		writes[i] = w
	}
	if firstErr != nil {
		p.metrics.recordFailed(ctx, reasonMap, unmapped)
		return nil, firstErr
	}
	outcomes, perWrite, err := p.gate.run(ctx, modeLive, "", writes, false)
	if err != nil && outcomes == nil { // refused before anything was sent
		p.metrics.recordFailed(ctx, failReason(err), len(writes))
		return nil, err
	}
	p.recordGated(ctx, batch, nil, writes, outcomes, perWrite)
	p.logBatch(ctx, batch, outcomes, nil)
	if err != nil {
		return nil, err
	}
	if errs := compact(perWrite); len(errs) > 0 {
		return outcomes, errors.Join(errs...)
	}
	return outcomes, nil
}

// Handle implements outbox.Handler. Unlike Project, it isolates bad
// records: a record that cannot be mapped, is invalid, meets an unreadable
// stored version, belongs to a collection whose version layout differs
// from the projector's (*LayoutMismatchError), or needs a key that holds
// another Redis type (*WrongKeyTypeError: the gate script names the write
// it stopped at, keeps the verdicts of the writes before it, which it
// applied or not, and the slot group's writes after it are sent again,
// each on its own, to find any other) gets its own Result.Err, so
// the relay retries only that record and dead-letters it after
// MaxAttempts, while the rest of the batch is applied and acknowledged.
//
// Redis errors are isolated the same way, by slot group: when the script
// call of one group fails (its Cluster master or Ring shard is down, a
// timeout, a cancelled context), each record of that group gets the
// call's error as its Result.Err, and the relay retries it after a
// backoff as it would a failed batch (the call may have run, so its
// writes may come back as duplicates), while the records of the groups
// whose calls succeeded are acknowledged and counted by their verdicts.
// Handle's own error is reserved for a call refused before anything was
// sent, such as one on a RedisProjector not made by NewRedisProjector.
func (p *RedisProjector) Handle(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
	if p.unmade() {
		return nil, unmadeProjector()
	}
	results := make([]outbox.Result, len(batch))
	writes := make([]Write, 0, len(batch))
	positions := make([]int, 0, len(batch)) // batch index of each write
	for i := range batch {
		w, err := p.mapRecord(i, batch[i])
		if err != nil {
			results[i].Err = err
			continue
		}
		writes = append(writes, w)
		positions = append(positions, i)
	}
	p.metrics.recordFailed(ctx, reasonMap, len(batch)-len(writes))
	outcomes, perWrite, err := p.gate.run(ctx, modeLive, "", writes, true)
	if err != nil { // refused before anything was sent
		p.metrics.recordFailed(ctx, failReason(err), len(writes))
		return nil, err
	}
	all := make([]Outcome, len(batch))
	for j, i := range positions {
		all[i] = outcomes[j]
		if err := perWrite[j]; err != nil {
			// Report the record's position, not the write's.
			var corrupt *CorruptVersionError
			var wrongType *WrongKeyTypeError
			switch {
			case errors.As(err, &corrupt):
				corrupt.Index = i
			case errors.As(err, &wrongType):
				wrongType.Index = i
			}
			results[i].Err = err
		}
	}
	p.recordGated(ctx, batch, positions, writes, outcomes, perWrite)
	p.logBatch(ctx, batch, all, results)
	return results, nil
}

// recordGated records the lag of the records the gate applied and counts,
// by reason, the records whose write has an error in perWrite: refused by
// the gate, or in a slot group whose script call failed. writes[j] is the
// write of batch[positions[j]] (of batch[j] when positions is nil).
func (p *RedisProjector) recordGated(ctx context.Context, batch []outbox.Record, positions []int, writes []Write, outcomes []Outcome, perWrite []error) {
	if p.metrics == nil {
		return
	}
	written := writes
	if positions != nil {
		written = make([]Write, len(batch))
	}
	applied := make([]bool, len(batch))
	for j := range writes {
		i := j
		if positions != nil {
			i = positions[j]
			written[i] = writes[j]
		}
		applied[i] = outcomes[j] == OutcomeApplied
	}
	p.metrics.recordLag(ctx, batch, written, applied)
	corrupt, layout, other := 0, 0, 0
	for _, err := range perWrite {
		switch {
		case err == nil:
		case errors.Is(err, ErrCorruptVersion):
			corrupt++
		case errors.Is(err, ErrLayoutMismatch):
			layout++
		default: // the call failed, or a key holds another type
			other++
		}
	}
	p.metrics.recordFailed(ctx, reasonCorruptVersion, corrupt)
	p.metrics.recordFailed(ctx, reasonLayout, layout)
	p.metrics.recordFailed(ctx, reasonRedis, other)
}

// mapRecord maps and validates one record.
func (p *RedisProjector) mapRecord(i int, rec outbox.Record) (Write, error) {
	w, err := p.mapper.Map(rec)
	if err == nil {
		err = validateWrite(i, &w)
	}
	if err == nil {
		err = p.checkSizes(i, &w)
	}
	if err != nil {
		return Write{}, &MapError{Index: i, RecordID: rec.ID, Stream: rec.Stream, Err: err}
	}
	return w, nil
}

// maxQuotedTarget is the longest name and member, together, that
// checkSizes's error quotes.
const maxQuotedTarget = 1024

// checkSizes refuses a write with a value, member or name larger than
// Config.MaxValueBytes, which Redis would refuse by closing the connection
// and so fail every write sent with it. The target is left out of the
// error when the name or member is the oversized part, or long.
func (p *RedisProjector) checkSizes(i int, w *Write) error {
	// Redis receives the name inside its keys, escaped and with the prefix
	// and the longest suffix the gate writes (":z~rebuild~copied").
	keyLen := p.gate.ks.MaxKeyLen(w.Target.Name)
	switch {
	case keyLen > p.maxValue || len(w.Target.Member) > p.maxValue:
		return &InvalidTargetError{Index: i, Target: Target{Kind: w.Target.Kind}, Reason: fmt.Sprintf("its keys (%d bytes for a name of %d) or member (%d bytes) are over Config.MaxValueBytes (%d)", keyLen, len(w.Target.Name), len(w.Target.Member), p.maxValue)}
	case len(w.Value.Data) > p.maxValue:
		target := w.Target
		if len(target.Name)+len(target.Member) > maxQuotedTarget {
			target = Target{Kind: target.Kind}
		}
		return &InvalidTargetError{Index: i, Target: target, Reason: fmt.Sprintf("its value is %d bytes, over Config.MaxValueBytes (%d)", len(w.Value.Data), p.maxValue)}
	}
	return nil
}

func (p *RedisProjector) logBatch(ctx context.Context, batch []outbox.Record, outcomes []Outcome, results []outbox.Result) {
	p.warnConflicts(ctx, batch, outcomes)
	if !p.logger.Enabled(ctx, slog.LevelDebug) {
		return
	}
	var applied, duplicate, stale, conflict, failed int
	for i, o := range outcomes {
		switch {
		case results != nil && results[i].Err != nil, o == OutcomeUnknown:
			failed++
		case o == OutcomeApplied:
			applied++
		case o == OutcomeDuplicate:
			duplicate++
		case o == OutcomeStale:
			stale++
		case o == OutcomeConflict:
			conflict++
		}
	}
	p.logger.DebugContext(ctx, "projection: batch projected", "records", len(batch),
		"applied", applied, "duplicate", duplicate, "stale", stale, "conflict", conflict, "failed", failed)
}

// warnConflicts logs the batch's first OutcomeConflict as a warning, with
// how many the batch had, unless this projector logged one less than a
// second ago (the line then reports, as suppressed, the batches not
// logged; the metrics count every conflict).
func (p *RedisProjector) warnConflicts(ctx context.Context, batch []outbox.Record, outcomes []Outcome) {
	first, n := -1, 0
	for i, o := range outcomes {
		if o == OutcomeConflict {
			if first < 0 {
				first = i
			}
			n++
		}
	}
	if n == 0 {
		return
	}
	log, suppressed := p.conflicts.Allow()
	if !log {
		return
	}
	rec := batch[first]
	p.logger.WarnContext(ctx, "projection: a record's version is stored with another value; the stored one was kept "+
		"(one version, two states: the source reused the version, the Mapper changed, or the stored value was edited; "+
		"if the source holds another state at that version, reconcile finds the entity corrupt)",
		"record_id", rec.ID, "event_id", rec.EventID, "stream", rec.Stream, "key", rec.Key, "version", rec.Version,
		"conflicts_in_batch", n, lograte.Suppressed, suppressed)
}

func compact(errs []error) []error {
	var out []error
	for _, err := range errs {
		if err != nil {
			out = append(out, err)
		}
	}
	return out
}
