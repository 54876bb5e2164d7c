package outbox

import (
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"
)

const (
	// BatchSizeDefault is the default for RelayConfig.BatchSize.
	BatchSizeDefault = 1000
	// BatchSizeMax is the largest RelayConfig.BatchSize accepted.
	BatchSizeMax = 10_000
	// LeaseDurationDefault is the default for RelayConfig.LeaseDuration.
	LeaseDurationDefault = 30 * time.Second
	// PollIntervalDefault is the default for RelayConfig.PollInterval.
	PollIntervalDefault = 5 * time.Second
	// MaxAttemptsDefault is the default for RelayConfig.MaxAttempts.
	MaxAttemptsDefault = 10
	// RetryBackoffMinDefault is the default for RelayConfig.RetryBackoffMin.
	RetryBackoffMinDefault = time.Second
	// RetryBackoffMaxDefault is the default for RelayConfig.RetryBackoffMax.
	RetryBackoffMaxDefault = 10 * time.Minute
	// ShutdownTimeoutDefault is the default for RelayConfig.ShutdownTimeout.
	ShutdownTimeoutDefault = 10 * time.Second
	// ReconnectBackoffMaxDefault is the default for
	// RelayConfig.ReconnectBackoffMax.
	ReconnectBackoffMaxDefault = 5 * time.Second
	// ListenCheckIntervalDefault is the default for
	// RelayConfig.ListenCheckInterval and ListenerConfig.ListenCheckInterval.
	ListenCheckIntervalDefault = 10 * time.Second
	// StatsIntervalDefault is the default for RelayConfig.StatsInterval.
	StatsIntervalDefault = 15 * time.Second
)

// RelayConfig configures a Relay. A nil *RelayConfig means all defaults.
// Zero fields take their defaults; negative durations and counts are errors.
type RelayConfig struct {
	// Schema is the schema of the outbox tables, as given to Migrate. A
	// name Config.Schema refuses (one beginning with "pg_") is refused here
	// too. Defaults to SchemaDefault ("public").
	Schema string

	// Table is the outbox table, as given to Migrate. A name Config.Table
	// refuses (one ending in a derived suffix such as "_dead") is refused
	// here too. Defaults to TableDefault ("verity_outbox").
	Table string

	// BatchSize is the most rows claimed, handed to the Handler and
	// acknowledged together. A relay pays two round trips per batch (the
	// claim and the settle) and one lease row write per partition whatever
	// its size, so larger batches drain a backlog faster; they do not delay
	// a trickle of rows (a claim takes whatever is due, up to BatchSize). The default suits the projection package's gate, which
	// applies a batch in one script call per Redis node (Cluster: per
	// slot) and takes in the order of 10ms for 1,000 writes, while that
	// Redis node serves nobody else; larger batches lengthen that pause,
	// and the Handler must finish a batch well within LeaseDuration. At
	// most BatchSizeMax. Defaults to BatchSizeDefault (1000).
	BatchSize int

	// LeaseDuration is how long a claim lasts. A claim leases the
	// partitions its rows belong to (see "Partition leases" in the package
	// documentation); while the lease lasts no other relay takes rows of
	// those partitions; when it ends without being settled (the relay died,
	// hung or lost its database connection) any relay leases them again and
	// counts the unfinished attempt. A relay whose settle failed (its
	// connection lost as PostgreSQL restarted, say) ends that lease itself
	// before its next claim, once the database answers, rather than leave
	// the rows waiting for it. The Handler's context expires with the
	// lease. Choose it well above the Handler's worst expected latency. At
	// least 100ms plus 10µs per row of BatchSize (200ms at BatchSizeMax),
	// as the claim itself runs within it; a shorter one is refused with a
	// *ConfigError.
	// Defaults to LeaseDurationDefault (30s).
	LeaseDuration time.Duration

	// PollInterval is how often an idle relay looks for due rows without
	// being notified. Notifications wake it at once; polling picks up rows
	// whose backoff or lease expired, and covers a lost LISTEN connection.
	// Must be at least 1ms. Defaults to PollIntervalDefault (5s).
	PollInterval time.Duration

	// MaxAttempts is how many times a row is claimed before a failure moves
	// it to the dead-letter table. An attempt whose relay stopped without
	// settling it (it crashed, or hung past its lease) counts as a failure
	// (see the package doc). The relay never hands out a row's attempt past
	// it: a row it reads with MaxAttempts attempts counted already is moved
	// to the dead-letter table. Defaults to MaxAttemptsDefault (10).
	MaxAttempts int

	// RetryBackoffMin is the delay before the second attempt of a failed
	// row. The delay doubles with each attempt up to RetryBackoffMax; each
	// delay is jittered uniformly within its upper half, so failures of many
	// rows do not retry in lockstep. Defaults to RetryBackoffMinDefault (1s).
	RetryBackoffMin time.Duration

	// RetryBackoffMax caps the retry delay. Must be at least
	// RetryBackoffMin. Defaults to RetryBackoffMaxDefault (10m).
	RetryBackoffMax time.Duration

	// ShutdownTimeout bounds how long Run, once its context is cancelled,
	// waits for the in-flight batch's Handler (a claim already sent
	// included) and for a LISTEN or metrics Stats statement in flight.
	// Within it the Handler finishes normally and its results are settled;
	// past it the Handler's context is cancelled and the rows it did not
	// complete are released for immediate re-delivery. The settle itself is
	// bounded separately (10 s, and 5 s for a cut-off claim's release), so
	// Run can return up to about ShutdownTimeout + 15 s after its context
	// ends against a database that stops answering; see the package
	// documentation. A Handler blocked in a call that ignores cancellation
	// holds Run longer: go-redis does not end a command in flight when its
	// context is cancelled, so a projection.RedisProjector's command ends
	// only at its connection's deadline, the client's ReadTimeout after it
	// was sent (and up to its WriteTimeout more while Redis stalls the
	// sending) or, with ContextTimeoutEnabled, the Handler context's
	// deadline if that comes first: the end of the claim's lease
	// (LeaseDuration, counted from just before the claim was sent).
	// Defaults to ShutdownTimeoutDefault (10s).
	ShutdownTimeout time.Duration

	// ReconnectBackoffMax caps the pause after a database error, both
	// before reconnecting the LISTEN connection (a shared Listener's own
	// ListenerConfig.ReconnectBackoffMax applies to it instead) and before
	// claiming again.
	// Pauses start at 100ms and double until a success. Notifications do
	// not cut the pause before claiming short, and PollInterval does not
	// cap it. Must be at least 1ms. Defaults to ReconnectBackoffMaxDefault
	// (5s).
	ReconnectBackoffMax time.Duration

	// ListenCheckInterval is how long the relay's LISTEN connection may
	// receive no notification before the relay pings it; a ping that does
	// not answer within the same time counts as a failed connection, which
	// is closed and opened again (the relay then claims, since
	// notifications sent meanwhile are lost). Waiting for a notification
	// only reads from the socket, so without the ping a connection that a
	// middlebox or a frozen peer stopped passing traffic on, without
	// closing it (half-open), would go unnoticed until the operating
	// system's TCP keepalive gave up, if ever, and rows would wait for
	// PollInterval meanwhile. It also bounds opening the connection
	// (BeforeConnect included), AfterConnect and the LISTEN statement, each:
	// a value shorter than they take fails every attempt (logged at Warn,
	// naming this setting), and rows then wait for PollInterval.
	// A shared Listener's own ListenerConfig.ListenCheckInterval applies to
	// it instead. Must be at least 1ms. Defaults to
	// ListenCheckIntervalDefault (10s).
	ListenCheckInterval time.Duration

	// KeepPublished keeps acknowledged rows, marked with published_at, for
	// audit, instead of deleting them. The partial indexes exclude them, so
	// claims and Stats stay cheap; deleting old published rows is then the
	// application's job. Defaults to false (delete on acknowledgement).
	KeepPublished bool

	// DurableBookkeeping makes the relay's claim and settle statements wait
	// for their commit to be flushed to disk (and to synchronous standbys),
	// like any other transaction. By default they commit with
	// synchronous_commit = off, scoped to each statement: a database crash
	// can then forget the last fraction of a second of claims and
	// acknowledgements, which only causes re-deliveries that the version
	// gate answers as duplicates (see "Non-durable bookkeeping" in the
	// package documentation), while a batch no longer waits for two WAL
	// flushes. Set it if a re-delivery after a database crash is costly for
	// your Handler, or if an operator must be able to rely on an
	// acknowledgement surviving a crash. The outbox rows themselves, written
	// in the caller's transaction, and ReplayDead commit as the session's
	// synchronous_commit says: durably, unless the pool's role, database or
	// connection sets it off (then a crash can forget a replay ReplayDead
	// reported; the dead letters stay). With DurableBookkeeping the relay's
	// statements too follow the session's setting. Defaults to false.
	DurableBookkeeping bool

	// DisableNotify turns off LISTEN: the relay finds work by polling only.
	// Use it behind a transaction-pooling proxy (PgBouncer in transaction
	// mode) that cannot hold a LISTEN session. Without it, the LISTEN
	// connection finds such a proxy: after each LISTEN it sends a probe
	// notification through the pool (without holding notifications back
	// meanwhile), and when that has not come back within ListenCheckInterval
	// (5 s at least) of being sent, it logs a warning naming this field (to
	// Logger; a Listener's to ListenerConfig.Logger) and reconnects with its
	// growing pause; each LISTEN stays registered on a server connection of
	// the proxy. Every LISTEN connection of the database receives every
	// other's probe, once per connection made, and ignores it. A relay with
	// a Listener cannot set this field: unset Listener too. Defaults to
	// false.
	DisableNotify bool

	// Listener, when set, is the LISTEN connection the relay shares with
	// the other relays of the process given the same Listener, instead of
	// holding one of its own while it runs: with a relay per stream (a
	// leaderboard Worker per board), the process then holds one connection
	// outside the pool rather than one per relay. It must be made by
	// NewListener for the relay's Schema and Table, with a pool of the
	// relay's database (NewRelay checks the table, not the database), and
	// cannot be combined with DisableNotify. The relay stops sharing it
	// when Run's context ends; the last relay to stop closes the
	// connection, giving a LISTEN statement in flight its ShutdownTimeout,
	// before its Run returns. The Listener's own Logger,
	// ReconnectBackoffMax and ListenCheckInterval apply to the connection. Defaults to nil (a
	// connection of the relay's own).
	Listener *Listener

	// Streams, when not empty, restricts the relay to rows of these streams,
	// so that different processes can serve different projections. Leave
	// it empty only when this relay's handler serves every stream written
	// to Table: otherwise it also claims rows another component's relay
	// should project (a leaderboard board's rows, stream "leaderboard:" +
	// its name, are in the default table unless its Config.OutboxTable
	// names another), and its handler either projects them where its own
	// mapper says, and the row is deleted, or fails them until they are
	// dead-lettered (projection.ErrUnmappedStream). Such a
	// relay leases partitions like any other: while its batch runs, relays
	// serving other streams skip those partitions and take others. The
	// claim finds due rows through the partition index, which does not
	// hold the stream, so it reads past the other streams' pending rows:
	// a stream whose relays are down, with a backlog of N rows, costs the
	// relays of the other streams O(N) per claim (about 0.2 s per claim at
	// 300,000 rows on a 2-core VM). Give such streams tables of their own
	// (Config.Table and RelayConfig.Table) if one may pile up while the
	// others are served. A notification whose payload names a stream
	// not listed here does not wake the relay (Append, a Notifier with
	// NotifierConfig.Stream and the leaderboard send their rows' stream);
	// an empty payload wakes it. A restricted relay's settle notifies the
	// streams of other streams' rows due behind its batch in each
	// partition it releases: the first, and of those due for more than
	// 2 s the youngest and one picked at random (see "Waking relays" in
	// the package documentation). Relays of different streams take turns
	// on a shared partition, one batch at a time, and a trickle of writes
	// lands in one or two partitions (256 consecutive ids each): with N
	// streams' relays busy in one, a row may wait about N batches
	// (measured: 50 streams writing 10 rows/s each, 40 ms batches, p99
	// about 3 s), and a row more than 32 rows behind another stream's
	// backlog there may wait for most of that backlog (see "Waking
	// relays"): other reasons to give streams that must not wait on each
	// other tables of their own. Defaults to nil (every stream).
	Streams []string

	// Name identifies the relay in logs. Defaults to "relay-" followed by
	// random characters.
	Name string

	// Logger receives the relay's logs: among them, at Warn, a line for a
	// batch whose Handler failed some rows (at most one a second, counting
	// the batches left out under "suppressed"). Defaults to a logger that
	// discards everything.
	Logger *slog.Logger

	// MeterProvider receives the relay's metrics (verity.outbox.*, see the
	// README's metrics table): counters of claimed, acknowledged, retried,
	// dead-lettered, released and lease-lost rows, the handler's duration,
	// and, while Run runs, gauges of the backlog (pending, in flight,
	// retrying, dead letters, oldest pending age). Defaults to nil (left
	// nil by WithDefaults): nothing is recorded.
	MeterProvider metric.MeterProvider

	// StatsInterval is how often Run refreshes the Stats snapshot behind
	// the backlog gauges. Scrapes never query the database; they report
	// the latest snapshot, or nothing once it is older than two intervals
	// (the relay stopped, or its refreshes fail). Each refresh is one
	// Stats query, O(pending), cut off after StatsInterval or 5 s, whichever
	// is longer, so that one stuck on a connection that stopped answering
	// does not stop the later ones. Only used when MeterProvider is set. Must be at least 1ms. Defaults
	// to StatsIntervalDefault (15s).
	StatsInterval time.Duration
}

// WithDefaults returns a copy of c with every zero field set to its default.
// It is safe to call on a nil *RelayConfig.
func (c *RelayConfig) WithDefaults() *RelayConfig {
	out := RelayConfig{}
	if c != nil {
		out = *c
		out.Streams = append([]string(nil), c.Streams...)
	}
	setDefault(&out.Schema, SchemaDefault)
	setDefault(&out.Table, TableDefault)
	setDefault(&out.BatchSize, BatchSizeDefault)
	setDefault(&out.LeaseDuration, LeaseDurationDefault)
	setDefault(&out.PollInterval, PollIntervalDefault)
	setDefault(&out.MaxAttempts, MaxAttemptsDefault)
	setDefault(&out.RetryBackoffMin, RetryBackoffMinDefault)
	setDefault(&out.RetryBackoffMax, RetryBackoffMaxDefault)
	setDefault(&out.ShutdownTimeout, ShutdownTimeoutDefault)
	setDefault(&out.ReconnectBackoffMax, ReconnectBackoffMaxDefault)
	setDefault(&out.ListenCheckInterval, ListenCheckIntervalDefault)
	setDefault(&out.StatsInterval, StatsIntervalDefault)
	if out.Name == "" {
		out.Name = "relay-" + randomSuffix()
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	return &out
}

func setDefault[T comparable](field *T, def T) {
	var zero T
	if *field == zero {
		*field = def
	}
}

func (c *RelayConfig) validate() error {
	if err := validateNames(c.Schema, c.Table); err != nil {
		return err
	}
	positive := func(field string, v time.Duration) error {
		if v <= 0 {
			return &ConfigError{Field: field, Reason: fmt.Sprintf("is %s; use a positive duration, or zero for the default", v)}
		}
		return nil
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"LeaseDuration", c.LeaseDuration},
		{"RetryBackoffMin", c.RetryBackoffMin},
		{"RetryBackoffMax", c.RetryBackoffMax},
		{"ShutdownTimeout", c.ShutdownTimeout},
	} {
		if err := positive(d.field, d.v); err != nil {
			return err
		}
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"PollInterval", c.PollInterval},
		{"ReconnectBackoffMax", c.ReconnectBackoffMax},
		{"ListenCheckInterval", c.ListenCheckInterval},
		{"StatsInterval", c.StatsInterval},
	} {
		if err := validateInterval(d.field, d.v); err != nil {
			return err
		}
	}
	switch {
	case c.BatchSize < 1 || c.BatchSize > BatchSizeMax:
		return &ConfigError{Field: "BatchSize", Reason: fmt.Sprintf("is %d; use 1 to %d, or zero for the default", c.BatchSize, BatchSizeMax)}
	case c.MaxAttempts < 1:
		return &ConfigError{Field: "MaxAttempts", Reason: fmt.Sprintf("is %d; use at least 1, or zero for the default", c.MaxAttempts)}
	case c.RetryBackoffMax < c.RetryBackoffMin:
		return &ConfigError{Field: "RetryBackoffMax", Reason: fmt.Sprintf("is %s, below RetryBackoffMin (%s); raise it", c.RetryBackoffMax, c.RetryBackoffMin)}
	case c.LeaseDuration < leaseFloor(c.BatchSize):
		// The claim itself (a prepare on a new connection, then reading
		// and leasing up to BatchSize rows) runs within the lease.
		return &ConfigError{Field: "LeaseDuration", Reason: fmt.Sprintf("is %s, too short for a claim of BatchSize (%d) rows to finish within it; use at least %s", c.LeaseDuration, c.BatchSize, leaseFloor(c.BatchSize))}
	}
	if c.Listener != nil {
		if err := c.validateListener(); err != nil {
			return err
		}
	}
	for i, s := range c.Streams {
		if s == "" {
			return &ConfigError{Field: "Streams", Reason: fmt.Sprintf("element %d is empty; remove it", i)}
		}
		if reason := textProblem(s); reason != "" {
			return &ConfigError{Field: "Streams", Reason: fmt.Sprintf("element %d %s", i, reason)}
		}
		if len(s) > MaxStreamBytes {
			// No row can have such a stream: the relay would serve nothing.
			return &ConfigError{Field: "Streams", Reason: fmt.Sprintf("element %d is %d bytes; at most %d (MaxStreamBytes) are allowed", i, len(s), MaxStreamBytes)}
		}
	}
	return nil
}

func (c *RelayConfig) validateListener() error {
	switch l := c.Listener; {
	case l.unmade():
		return &ConfigError{Field: "Listener", Reason: "was not made by NewListener; create it with NewListener"}
	case c.DisableNotify:
		return &ConfigError{Field: "Listener", Reason: "is set with DisableNotify; unset one of them (DisableNotify turns notifications off, a Listener shares them)"}
	case l.conn.channel != channelName(c.Schema, c.Table):
		return &ConfigError{Field: "Listener", Reason: fmt.Sprintf(
			"listens for outbox %q.%q, not the relay's %q.%q; give the relay a Listener made with its Schema and Table",
			l.cfg.Schema, l.cfg.Table, c.Schema, c.Table)}
	}
	return nil
}

// leaseFloor is the least LeaseDuration for a BatchSize: a claim, which
// runs within the lease, takes a few milliseconds (its first on a
// connection prepares the statements) and a few µs a row.
func leaseFloor(batchSize int) time.Duration {
	return 100*time.Millisecond + time.Duration(batchSize)*10*time.Microsecond
}
