package leaderboard

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/clusterpin"
	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
)

// StreamPrefix prefixes the outbox stream of every board: a board named N
// appends to stream StreamPrefix+N.
const StreamPrefix = "leaderboard:"

// Command is one score change submitted by a client.
type Command struct {
	// EventID identifies the command. A client that retries must send the
	// same EventID; it makes Submit idempotent. It must not be uuid.Nil.
	EventID uuid.UUID
	// UserID is the user whose score changes: non-empty, at most
	// Config.MaxUserIDLength bytes, valid UTF-8 without NUL bytes
	// (PostgreSQL text cannot hold either). Any other character is fine —
	// spaces, braces, colons, newlines, emoji — and is stored verbatim.
	UserID string
	// Delta is added to the score; it must lie within
	// [Config.MinDelta, Config.MaxDelta].
	Delta int64
}

// Result is the outcome of a command.
type Result struct {
	// Score is the user's score right after the command.
	Score int64
	// Version is the user's version right after the command: 1 for the
	// first command of a user, one more for each later one. A read can ask
	// the projection for at least this version with AtLeast.
	Version int64
	// Duplicate is true when the event id had been applied before; Score
	// and Version are then the original result, and nothing was changed.
	Duplicate bool
}

// Board is one leaderboard. It is safe for concurrent use. Create it with
// New: the methods of a zero Board or a nil *Board return a *ConfigError
// (Field "Board") instead.
type Board struct {
	cfg  *Config
	pool *pgxpool.Pool
	rdb  redis.UniversalClient
	// primary is set when rdb may send read-only commands to replicas
	// (ReadOnly, RouteByLatency or RouteRandomly): the board then reads on
	// the master explicitly, because Freshness measures the projection's
	// lag on the masters only and a replica may be further behind.
	primary *redis.ClusterClient
	stream  string
	channel string
	// cursorTag binds the board's page cursors to it (cursorTagOf).
	cursorTag [cursorTagSize]byte
	ks        projection.Keyspace
	zsetKey   string
	// cachesStatements: the pool's DefaultQueryExecMode prepares named
	// statements and caches them (QueryExecModeCacheStatement), so
	// SubmitBatch may choose per batch between a cached and an unnamed
	// statement; in any other mode (CacheDescribe too, which pgx offers
	// for transaction-pooling proxies) every statement goes in the pool's
	// own mode.
	cachesStatements bool
	// simpleProtocol: the pool's DefaultQueryExecMode sends arguments
	// inline (QueryExecModeSimpleProtocol), and PostgreSQL plans each
	// statement for them whatever plan_cache_mode says.
	simpleProtocol bool
	// layoutKey records the bucket count the projection's versions are
	// stored with; layout is ks's count as the gate writes it there.
	layoutKey, layout string
	// unbucketedKey is the version hash of a projection without buckets
	// (this board's own version hash when it uses none), read with the
	// layout: without a layout key, it tells a projection of 0 buckets
	// from one that lost its layout key, as the gate does.
	unbucketedKey string
	// verifiedKey records that Verify found the projection complete (the
	// pass's token and time, see verified.lua); verifyingKey holds the
	// token of the Verify pass under way; heldKey holds the recording
	// pass's token and the sorted set's size then (absent when it was
	// empty). All share the sorted set's hash tag.
	verifiedKey, verifyingKey, heldKey string
	// outboxTag names the outbox table in Verify's record (see
	// projectionVerified): a record made for another table does not count.
	outboxTag string

	notifier *outbox.Notifier // wakes the relays after Submit and SubmitBatch
	group    submitGroup      // coalesces concurrent Submit calls

	sql struct {
		submit, submitTx, lookupEvent string
		submitBatch, submitBatchTx    string
		overflowProbe                 string
		top, page, pageBytes, rank    string
		around, lag                   string
		sourceFirst, sourcePage       string
		sourceSample, sourceLookup    string
		// atLeast maps each read statement above (top, page, pageBytes,
		// rank, around) to its variant for reads with AtLeast
		// requirements (withAtLeast).
		atLeast map[string]string
	}

	lagMu sync.Mutex
	// shortRecord is the token of a Verify record a look found with fewer
	// members than its pass saw (under lagMu): it never counts again, even
	// once new scores make the sorted set as large.
	shortRecord string
	lagProbe    lagProbe
	lagFirst    chan struct{} // closed when the first lag measurement ends
	// steppedThrough is the latest creation time of an unprojected change
	// a lag measurement found dated after the database clock (under
	// lagMu); zero when none. Until every change dated up to it is
	// projected, the lag stays unmeasured: once the clock passes such a
	// change, its age (and that of changes written before the step) is
	// understated by the step.
	steppedThrough time.Time
	// lastClock is the last successful lag reading's database clock and
	// the local times its query was sent and answered (under lagMu): a
	// database clock that advanced less than the local monotonic clock
	// between two readings stepped back.
	lastClock struct {
		dbNow, sent, replied time.Time
		conn                 *pgconn.PgConn
	}
	verification verification
	// lagGaugeProbe is closed when the measurement a metrics collection
	// started is over; nil while none runs.
	lagGaugeProbe chan struct{}

	metrics *boardMetrics // nil: no MeterProvider
	logs    readLogs      // limits warnings a failure would repeat per read
}

// New returns the Board cfg names. It does not touch the database or Redis;
// run Migrate once (per schema) before using it. pool must run at READ
// COMMITTED, PostgreSQL's default: with a stricter default isolation,
// concurrent Submits of one user fail with serialization errors (set
// ConnConfig.RuntimeParams["default_transaction_isolation"] back to "read
// committed" if the role's default is stricter). A pool whose
// DefaultQueryExecMode does not cache statements (behind a
// transaction-pooling proxy) is honoured by every statement. rdb must
// bound how long a command waits for Redis, since go-redis does not end a
// command in flight when its context is cancelled: a *redis.Client,
// *redis.ClusterClient or *redis.Ring whose ReadTimeout or WriteTimeout is
// -2, or -1 without ContextTimeoutEnabled, is refused with a *ConfigError
// naming "rdb" (a read could otherwise wait for a stalled Redis forever,
// and never fall back to PostgreSQL).
func New(pool *pgxpool.Pool, rdb redis.UniversalClient, cfg *Config) (*Board, error) {
	if pool == nil {
		return nil, &ConfigError{Field: "pool", Reason: "is nil; pass the *pgxpool.Pool of the board's database"}
	}
	if deps.Missing(rdb) {
		return nil, &ConfigError{Field: "rdb", Reason: "is nil; pass a redis.UniversalClient (a *redis.Client or *redis.ClusterClient)"}
	}
	if u := deps.UnboundedRedis(rdb); u != nil {
		return nil, &ConfigError{Field: "rdb", Reason: u.Field + " " + u.Reason}
	}
	if cfg == nil {
		return nil, &ConfigError{Field: "cfg", Reason: "is nil; pass a *Config (Name is required)"}
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	w, err := outbox.NewWriter(&outbox.Config{Schema: c.Schema, Table: c.OutboxTable})
	if err != nil {
		return nil, fromOutboxConfig("Config.", err)
	}
	ks, err := projection.NewKeyspace(c.KeyPrefix)
	if err != nil {
		return nil, fmt.Errorf("leaderboard: Config.KeyPrefix: %w", err)
	}
	if ks, err = ks.WithVersionBuckets(c.VersionBuckets); err != nil {
		return nil, fmt.Errorf("leaderboard: Config.VersionBuckets: %w", err)
	}
	mode := pool.Config().ConnConfig.DefaultQueryExecMode
	b := &Board{
		cachesStatements: mode == pgx.QueryExecModeCacheStatement,
		simpleProtocol:   mode == pgx.QueryExecModeSimpleProtocol,
		cfg:              c,
		pool:             pool,
		rdb:              rdb,
		stream:           StreamPrefix + c.Name,
		channel:          w.Channel(),
		cursorTag:        cursorTagOf(c),
		ks:               ks,
	}
	if b.notifier, err = outbox.NewNotifier(pool, w.Channel(), &outbox.NotifierConfig{Stream: b.stream, Logger: c.Logger}); err != nil {
		return nil, fmt.Errorf("leaderboard: %w", err)
	}
	b.group.b, b.group.stallAfter = b, submitStallAfter
	b.zsetKey = ks.ValueKey(b.target(""))
	b.layoutKey, b.layout = ks.LayoutKey(c.Name, projection.KindSortedSet), strconv.Itoa(ks.VersionBuckets())
	flat, _ := ks.WithVersionBuckets(0) // 0 buckets is always valid
	b.unbucketedKey = flat.VersionKeys(c.Name, projection.KindSortedSet)[0]
	b.verifiedKey, b.verifyingKey, b.heldKey = b.zsetKey+"~verified", b.zsetKey+"~verifying", b.zsetKey+"~verified~held"
	b.outboxTag = outboxTagPrefix + hex.EncodeToString([]byte(qualify(c.Schema, w.Config().Table)))
	b.primary = clusterpin.Client(rdb)
	r := func(q string) string { return renderSQL(q, c.Schema, w.Config().Table) }
	b.sql.submit, b.sql.submitTx, b.sql.lookupEvent = r(submitSQL), r(submitTxSQL), r(lookupEventSQL)
	b.sql.submitBatch, b.sql.submitBatchTx = r(submitBatchSQL), r(submitBatchTxSQL)
	b.sql.overflowProbe = r(overflowProbeSQL)
	b.sql.top, b.sql.page, b.sql.pageBytes = r(topSQL), r(pageSQL), r(pageBytesSQL)
	b.sql.rank, b.sql.around, b.sql.lag = r(rankSQL), r(aroundSQL), r(lagSQL)
	b.sql.sourceFirst, b.sql.sourcePage = r(sourceFirstSQL), r(sourcePageSQL)
	b.sql.sourceSample, b.sql.sourceLookup = r(sourceSampleSQL), r(sourceLookupSQL)
	entry := []string{"user_id", "score", "rank"}
	b.sql.atLeast = map[string]string{
		b.sql.top:       r(withAtLeast(topSQL, entry, 2)),
		b.sql.page:      r(withAtLeast(pageSQL, entry, 4)),
		b.sql.pageBytes: r(withAtLeast(pageBytesSQL, entry, 4)),
		b.sql.rank:      r(withAtLeast(rankSQL, []string{"score", "rank"}, 2)),
		b.sql.around:    r(withAtLeast(aroundSQL, entry, 3)),
	}
	// Last: the lag gauge's callback may run (and measure) as soon as it
	// is registered, so the board must be complete by then.
	if b.metrics, err = newBoardMetrics(c, b.observedLag); err != nil {
		b.notifier.Close()
		return nil, fmt.Errorf("leaderboard: %w", err)
	}
	return b, nil
}

// Close waits for the Submit and SubmitBatch statements under way to
// finish and stops the board's relay wake-ups (its outbox.Notifier),
// sending a pending one first. A call still waiting to join a statement
// is not waited for: it runs after Close returns, as any call after Close
// does. Calling it is good practice at shutdown but
// optional: the wake-up goroutine only runs while submits keep coming and
// exits within outbox.NotifierIdleTimeoutDefault (100 ms) of the last one,
// so a board that is dropped without Close leaves no goroutine behind. After
// Close the board still works; its Submit and SubmitBatch then no longer
// wake the relays, which find the rows at their next poll. With a
// Config.MeterProvider, Close also unregisters the verity.leaderboard.lag
// gauge, stops its prefetch timer (which starts a measurement shortly
// before the collection it expects) and waits for a lag measurement a
// collection or the prefetch started (the provider
// holds the board until then; a board dropped without Close keeps
// measuring its lag for the gauge, at most once per LagProbeInterval of
// collections). Close does not close the pool or the Redis client. It is
// safe to call more than once, and does nothing on a Board that New did
// not make.
func (b *Board) Close() {
	if b.notFromNew() {
		return
	}
	if err := b.metrics.close(); err != nil {
		b.cfg.Logger.Warn("leaderboard: unregistering the lag gauge failed", "board", b.cfg.Name, "error", err)
	}
	b.group.wait()
	b.notifier.Close()
}

// Name returns the board's name ("" for a Board that New did not make).
func (b *Board) Name() string {
	if b.notFromNew() {
		return ""
	}
	return b.cfg.Name
}

// notFromNew reports a Board that New did not make: a zero Board, or a nil
// *Board. Its methods refuse it with errBoardNotFromNew rather than panic;
// the check is two comparisons, nothing on Submit's budget.
func (b *Board) notFromNew() bool { return b == nil || b.cfg == nil }

// errBoardNotFromNew is the error of a method called on a Board that New
// did not make.
func errBoardNotFromNew() error {
	return &ConfigError{Field: "Board", Reason: "was not made by New: it has no pool or Redis client; create it with New(pool, rdb, cfg)"}
}

// Stream returns the outbox stream the board appends to: StreamPrefix+Name.
// It is "" for a Board not made by New.
func (b *Board) Stream() string {
	if b.notFromNew() {
		return ""
	}
	return b.stream
}

// Config returns a copy of the board's configuration, defaults applied:
// the zero Config for a Board not made by New.
func (b *Board) Config() Config {
	if b.notFromNew() {
		return Config{}
	}
	return *b.cfg
}

// Keyspace returns the Redis keyspace of the board's projection: the zero
// Keyspace for a Board not made by New.
func (b *Board) Keyspace() projection.Keyspace {
	if b.notFromNew() {
		return projection.Keyspace{}
	}
	return b.ks
}

// SortedSetKey returns the Redis key of the board's sorted set. Its scores
// are the NEGATED scores (see the package documentation on ordering). It
// is "" for a Board not made by New.
func (b *Board) SortedSetKey() string {
	if b.notFromNew() {
		return ""
	}
	return b.zsetKey
}

// target returns the projection target of user on this board.
func (b *Board) target(user string) projection.Target {
	return projection.Target{Kind: projection.KindSortedSet, Name: b.cfg.Name, Member: user}
}

// validate checks one command; index is its position in a batch.
func (b *Board) validate(index int, cmd Command) error {
	fail := func(field, reason string) error {
		return &ValidationError{Index: index, Field: field, Reason: reason}
	}
	switch {
	case cmd.EventID == uuid.Nil:
		return fail("EventID", "must be a non-nil UUID")
	case cmd.Delta < b.cfg.MinDelta || cmd.Delta > b.cfg.MaxDelta:
		return fail("Delta", fmt.Sprintf("%d is outside [%d, %d]", cmd.Delta, b.cfg.MinDelta, b.cfg.MaxDelta))
	}
	if reason := b.userIDProblem(cmd.UserID); reason != "" {
		return fail("UserID", reason)
	}
	return nil
}

// userIDProblem says why user cannot be a user id of the board, or "".
func (b *Board) userIDProblem(user string) string {
	switch {
	case user == "":
		return "must not be empty"
	case len(user) > b.cfg.MaxUserIDLength:
		return fmt.Sprintf("is %d bytes long; the limit is %d", len(user), b.cfg.MaxUserIDLength)
	case !utf8.ValidString(user):
		return "must be valid UTF-8"
	case strings.IndexByte(user, 0) >= 0:
		return "must not contain NUL bytes"
	}
	return ""
}

// Submit applies cmd and returns the user's resulting score and version.
//
// The event record, the score change and the outbox row carrying the
// absolute score commit together, in one statement sent in one round trip.
// Calls made while the board's Submit statements are busy share the next
// one (see Config.MaxSubmitsPerStatement); the outcome of each is what it
// would have been alone. If ctx ends before the call's statement is sent
// (while it is queued, or its group waits for a pool connection), it
// writes nothing; if it ends once the statement was sent, the command may
// have committed, as with any statement cancelled in flight, and retrying
// with the same event id is safe (pgx closes the connection of a statement
// cancelled in flight, so a call after it may wait for a new connection and
// its prepared statements: tens of milliseconds on a loaded machine, which
// short deadlines should leave room for; over TLS, a cut between two of the
// statement's writes makes pgx wait out its 15 s deadline before that
// connection is closed, and your pool's Close waits for it, as the outbox
// package doc says). Likewise when the connection breaks (or
// the server dies) once the statement was sent: the error then matches
// ErrOutcomeUnknown, and a retry with the same event id returns the
// original Result with Duplicate set if the first attempt committed.
// The relays are woken after the commit, by the board's outbox.Notifier
// (coalesced, at most one NOTIFY per millisecond, sent on its own); if the
// process dies between the commit and that NOTIFY, the relays find the row at
// their next poll: the change is delayed, never lost. Submitting an event id again changes nothing and returns the
// original Result with Duplicate set, also when the twins race; reusing an
// event id for a different command returns an *IdempotencyConflictError,
// and an event id on another outbox writer's row still in the outbox table
// returns ErrIdempotencyConflict alone (see ErrIdempotencyConflict).
// Invalid commands return a *ValidationError and a resulting score outside
// [MinScore, MaxScore] a *ScoreOutOfRangeError; in each of these error
// cases nothing is written. To submit inside a transaction of your own,
// use SubmitTx.
func (b *Board) Submit(ctx context.Context, cmd Command) (Result, error) {
	if b.notFromNew() {
		return Result{}, errBoardNotFromNew()
	}
	res, err := b.submit(ctx, cmd)
	err = withCallerEnded(ctx, err)
	b.metrics.submitted(ctx, 1, outcomeApplied, res.Duplicate, err)
	return res, err
}

func (b *Board) submit(ctx context.Context, cmd Command) (Result, error) {
	if err := b.validate(0, cmd); err != nil {
		return Result{}, err
	}
	if b.cfg.MaxSubmitsPerStatement == 1 {
		defer b.group.track()()
		return b.submitOne(ctx, cmd)
	}
	return b.group.submit(ctx, cmd)
}

// submitOne applies a validated command in a statement of its own.
func (b *Board) submitOne(ctx context.Context, cmd Command) (Result, error) {
	// A connection of its own, released even if an application's pgx
	// tracer panics in the statement: pgxpool's QueryRow takes one before
	// TraceQueryStart and gives it back only in Scan, so such a panic lost
	// it for good (and pool.Close then waited for it for ever).
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return Result{}, b.dbError("submit", err) // nothing sent
	}
	defer conn.Release()
	res, err := b.submitStatement(ctx, conn, "submit", b.sql.submit, cmd)
	if err == nil && !res.Duplicate {
		b.notifier.Notify() // committed: autocommit statement
	}
	if !isUniqueViolation(err) || b.outboxIDClash(err) {
		return res, err
	}
	// The driver's unique violation stays reachable (errors.As), as in
	// every other statement error of the board.
	violation := err
	if violatedTable(err) == b.cfg.OutboxTable {
		return Result{}, fmt.Errorf("leaderboard: event %s is already used by another outbox writer: %w (%w)", cmd.EventID, ErrIdempotencyConflict, violation)
	}
	// A twin committed after our snapshot; it is recorded now. Our
	// statement was its own transaction, so a follow-up read is possible.
	var (
		board, user string
		delta       int64
	)
	err = conn.QueryRow(ctx, b.sql.lookupEvent, binaryUUID(cmd.EventID)).Scan(&board, &user, &delta, &res.Score, &res.Version)
	if errors.Is(err, pgx.ErrNoRows) {
		return Result{}, fmt.Errorf("leaderboard: event %s is already used by another outbox writer: %w (%w)", cmd.EventID, ErrIdempotencyConflict, violation)
	}
	if err != nil {
		return Result{}, b.dbError(fmt.Sprintf("submit: reading the concurrent twin of event %s", cmd.EventID), err)
	}
	res.Duplicate = true
	return b.checkDuplicate(cmd, res, board, user, delta)
}

// SubmitTx is Submit inside the caller's transaction: the score change, the
// event record and the outbox row commit or roll back with tx, together
// with whatever else the caller writes in it. tx is a pgx.Tx, or a *sql.Tx
// of the pgx stdlib driver wrapped by outbox.SQLTx. It costs the same
// single statement as Submit. A *pgxpool.Pool, or a *pgx.Conn or
// *pgxpool.Conn outside a transaction, is refused with a *ConfigError
// (Field "tx"), nothing written: its statements commit on their own.
//
// tx must be a transaction of the board's own database, the one its pool
// (New's pool) connects to: the board cannot tell. On another database
// where the board's tables were migrated too, SubmitTx succeeds and the
// outbox row never reaches this board's relays; on one without them it
// fails with ErrNotMigrated.
//
// The outbox row's creation time, which the lag counts from
// (Freshness.Lag), is the start of tx (PostgreSQL's now()): a long
// transaction commits a change that already looks that old, and reads
// report the lag, against Config.MaxLag too, until it is projected. Reads
// that reuse a lag measurement taken while tx was open (for up to
// Config.LagProbeInterval) do not see the change yet, and report too
// small a lag by up to how long tx had been open then.
//
// Unlike Submit, the statement itself notifies the relays (pg_notify,
// delivered when tx commits and never if it rolls back): the board cannot
// tell when, or whether, the caller commits, and a wake-up that depends on
// the caller remembering a call after commit would be easy to lose. The
// price is PostgreSQL's: a notifying transaction holds a database-wide lock
// through its commit's WAL flush, so many concurrent SubmitTx commits do not
// group-commit. For bulk work use SubmitBatch, or Submit.
//
// Each call writes its own outbox row, the user's score after that call.
// Two calls for one user in one tx (+10, then -10) commit one score, 0, and
// two rows, 10 and 0; a relay may project them in separate batches, and a
// read between the two then shows 10, a score the commit never left (the
// first call's Result; reads report the lag until the second is
// projected). To apply several commands of one user in one transaction,
// pass them to one SubmitBatchTx, which writes only each user's last
// score.
//
// A duplicate event id (committed before the statement's snapshot: the
// statement's own under READ COMMITTED, the transaction's under REPEATABLE
// READ or SERIALIZABLE) returns
// the original Result with Duplicate set and writes nothing; the caller
// decides whether to commit the rest of its transaction (usually not: the
// first submission already did its work). An *IdempotencyConflictError and
// a *ValidationError also write nothing and leave tx usable.
//
// Any error the database raises aborts tx, as PostgreSQL aborts a
// transaction on any error: *ScoreOutOfRangeError, and these two:
//
//   - *ConcurrentSubmitError (errors.Is(err, ErrConcurrentSubmit)): a twin
//     with the same event id committed while this statement ran (a client
//     retry that raced its original). Roll tx back and retry the whole
//     transaction: the retry sees the twin and reports Duplicate (or an
//     *IdempotencyConflictError if the commands differ). Submit answers
//     this case itself with a follow-up read, which an aborted transaction
//     cannot run; SubmitTx does not use a savepoint to get around that,
//     because a savepoint per call is an extra round trip and many of them
//     in one transaction overflow PostgreSQL's subtransaction cache.
//   - ErrIdempotencyConflict without a *IdempotencyConflictError: another
//     writer of the same outbox has a row with the event id in the outbox
//     table, undelivered (or delivered and kept). It is reported only while
//     that row is there: once a relay deletes it, the same command is
//     accepted (see ErrIdempotencyConflict). Use a new event id. The
//     error also wraps the driver's unique violation (*pgconn.PgError).
//
// Under REPEATABLE READ or SERIALIZABLE, a concurrent update of the same
// user (a twin among them) may also fail with a serialization failure
// (SQLSTATE 40001), and under SERIALIZABLE so may a twin committed while
// the statement ran, whatever its user: PostgreSQL reports it as that
// failure, not as the unique violation behind a *ConcurrentSubmitError.
// It is returned wrapped; retry the transaction as for any such failure
// (the retry sees the twin and reports Duplicate).
//
// The verity.leaderboard.submits counter counts a SubmitTx that wrote its
// command as staged, not applied: whether tx commits is the caller's to
// see, not the board's.
func (b *Board) SubmitTx(ctx context.Context, tx outbox.Tx, cmd Command) (Result, error) {
	if b.notFromNew() {
		return Result{}, errBoardNotFromNew()
	}
	res, err := b.submitTx(ctx, tx, cmd)
	b.metrics.submitted(ctx, 1, outcomeStaged, res.Duplicate, err)
	return res, err
}

// errNilTx refuses a nil transaction given to method.
func errNilTx(method string) error {
	return &ConfigError{Field: "tx", Reason: "is nil; " + method + " needs the caller's open transaction (a pgx.Tx, or outbox.SQLTx of a *sql.Tx)"}
}

// errNotATransaction refuses a pool or an idle connection given as a
// *Tx method's tx (see deps.NotInTransaction).
func errNotATransaction(method, why string) error {
	return &ConfigError{Field: "tx", Reason: why + "; " + method + " needs the caller's open transaction (pool.Begin), so that the score commits with the caller's own writes"}
}

func (b *Board) submitTx(ctx context.Context, tx outbox.Tx, cmd Command) (Result, error) {
	if deps.Missing(tx) {
		return Result{}, errNilTx("SubmitTx")
	}
	if why := deps.NotInTransaction(tx); why != "" {
		return Result{}, errNotATransaction("SubmitTx", why)
	}
	if err := b.validate(0, cmd); err != nil {
		return Result{}, err
	}
	res, err := b.submitStatement(ctx, tx, opSubmitTx, b.sql.submitTx, cmd, b.channel)
	if !isUniqueViolation(err) || b.outboxIDClash(err) {
		return res, err
	}
	if violatedTable(err) == b.cfg.OutboxTable {
		return Result{}, fmt.Errorf("leaderboard: event %s is already used by another outbox writer (the transaction is aborted): %w (%w)", cmd.EventID, ErrIdempotencyConflict, err)
	}
	return Result{}, &ConcurrentSubmitError{EventID: cmd.EventID}
}

// rowQuerier is what submitStatement needs: a pool or a transaction.
type rowQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// submitStatement runs query (submitSQL, or submitTxSQL with the channel
// as extra) for a validated command; op names it in errors (dbError). A unique
// violation (a twin committed after the statement's snapshot, or another
// outbox writer's event id) is returned unwrapped for the caller to
// interpret; every other outcome is final.
func (b *Board) submitStatement(ctx context.Context, q rowQuerier, op, query string, cmd Command, extra ...any) (Result, error) {
	var (
		res         Result
		board, user string
		delta       int64
	)
	args := append([]any{binaryUUID(cmd.EventID), b.cfg.Name, cmd.UserID, cmd.Delta, b.stream}, extra...)
	err := q.QueryRow(ctx, query, args...).Scan(&res.Duplicate, &res.Score, &res.Version, &board, &user, &delta)
	switch {
	case err == nil:
	case b.outboxIDClash(err):
		return Result{}, b.dbError(op, err)
	case isUniqueViolation(err):
		return Result{}, err
	case isScoreRangeViolation(err):
		return Result{}, &ScoreOutOfRangeError{UserID: cmd.UserID, Delta: cmd.Delta}
	case op == "submit": // autocommit: a broken answer leaves the commit unknown
		return Result{}, outcomeUnknown(b.dbError(op, err))
	default:
		return Result{}, b.dbError(op, err)
	}
	return b.checkDuplicate(cmd, res, board, user, delta)
}

// binaryUUID wraps id so that pgx sends it in binary. A uuid.UUID is a
// driver.Valuer, which pgx encodes through its text form: a string
// allocation and a server-side parse on every command (about 2% of the
// client's CPU in the ingest benchmark).
func binaryUUID(id uuid.UUID) pgtype.UUID { return pgtype.UUID{Bytes: id, Valid: true} }

// checkDuplicate refuses a duplicate whose recorded command differs.
func (b *Board) checkDuplicate(cmd Command, res Result, board, user string, delta int64) (Result, error) {
	if res.Duplicate && (board != b.cfg.Name || user != cmd.UserID || delta != cmd.Delta) {
		return Result{}, &IdempotencyConflictError{EventID: cmd.EventID, Board: board, UserID: user, Delta: delta, Attempted: cmd}
	}
	return res, nil
}

// SubmitBatch applies many commands in one statement, for bulk imports and
// backfills. It returns one Result per command, in order.
//
// Every command is validated first; any invalid command fails the whole
// batch with a *ValidationError (Index says which) and nothing is written.
// Likewise an event id reused for a different command (within the batch or
// against an earlier submission) fails the batch with an
// *IdempotencyConflictError, which describes the recorded command (see its
// fields; with several such commands, a reuse within the batch if there
// is one, else the first in cmds' order), an event id on another outbox
// writer's row still in the outbox table with ErrIdempotencyConflict
// alone, and an out-of-range score, even an intermediate one, with a
// *ScoreOutOfRangeError. Commands whose event id
// was applied before are reported as duplicates with their original result.
// The batch is one statement: it commits whole or not at all. When the
// connection breaks (or the server dies) once it was sent, the error
// matches ErrOutcomeUnknown: retry the batch with the same event ids, and
// commands that committed come back as duplicates. So may a batch whose
// ctx ended once it was sent, which returns ctx's error: as with Submit,
// it may have committed, and the same retry answers.
//
// Commands of the same user are applied in batch order, each getting its
// own version; the outbox receives only each user's final state (the
// projection would skip the intermediate ones anyway). As with Submit, the
// relays are woken after the commit by the board's outbox.Notifier.
func (b *Board) SubmitBatch(ctx context.Context, cmds []Command) ([]Result, error) {
	if b.notFromNew() {
		return nil, errBoardNotFromNew()
	}
	out, err := func() ([]Result, error) {
		defer b.group.track()()
		out, err := b.submitBatch(ctx, cmds, batchOptions{})
		return out, withCallerEnded(ctx, err)
	}()
	if err != nil {
		b.metrics.submitted(ctx, len(cmds), outcomeApplied, false, err)
		return out, err
	}
	dup := 0
	for _, r := range out {
		if r.Duplicate {
			dup++
		}
	}
	b.metrics.submitted(ctx, len(out)-dup, outcomeApplied, false, nil)
	b.metrics.submitted(ctx, dup, outcomeApplied, true, nil)
	return out, nil
}

// SubmitBatchTx is SubmitBatch inside the caller's transaction tx (a
// pgx.Tx, or a database/sql transaction through outbox.SQLTx): the
// commands' score changes and outbox rows commit or roll back with the
// caller's own writes, in one statement and one round trip (a pool or a
// connection outside a transaction is refused, as by SubmitTx). It returns one
// Result per command, in order, and reports duplicates, invalid commands
// and reused event ids as SubmitBatch does; those failures write nothing
// and leave tx usable. As with SubmitTx, nothing is visible to others, nor
// sent to Redis, until tx commits, and the relays are woken when it does
// (a notification queued in tx, once per call).
//
// These failures abort tx (PostgreSQL refuses its every later statement):
// roll it back, and retry the whole transaction where the error says so.
//
//   - *ConcurrentSubmitError (errors.Is(err, ErrConcurrentSubmit)): another
//     transaction committed a command with one of the batch's event ids
//     while the statement ran. The retry reports it as a duplicate (or
//     fails with an *IdempotencyConflictError if the commands differ).
//     EventID is that id when the server's message names it, else uuid.Nil.
//   - *ScoreOutOfRangeError with Index -1: a command would leave the score
//     range. SubmitBatch finds which by reading the scores again, which
//     an aborted transaction cannot; the caller's transaction may also hold
//     score changes nobody else can see, so the board does not guess.
//   - ErrIdempotencyConflict without a *IdempotencyConflictError: another
//     writer of the same outbox has a row with one of the event ids in the
//     outbox table (see SubmitTx).
//   - A deadlock (SQLSTATE 40P01), which SubmitBatch retries itself, or
//     under REPEATABLE READ or SERIALIZABLE a serialization failure
//     (40001), which is also how PostgreSQL reports a twin committed
//     meanwhile (under REPEATABLE READ one of the same user, under
//     SERIALIZABLE any): returned wrapped; retry the transaction.
//
// The statement locks the batch's users' rows until tx ends, in user id
// order, as SubmitBatch's does; a transaction that also changes them
// elsewhere should change them in that order too, or risk a deadlock.
// Batches above MaxSubmitsPerStatementDefault commands in a pgx.Tx whose
// connection caches statements are sent unnamed, so that PostgreSQL plans
// each for its arrays (see SubmitBatch); through database/sql (whose
// driver may cache the statement, and a cached statement switches to a
// generic plan after five runs), and in a pgx.Tx not using the simple
// protocol (the caller's session or role may force generic plans), the
// statement is wrapped in two short ones in tx, which set plan_cache_mode
// to force_custom_plan and then put the caller's setting back. Once the
// batch is in tx, ctx does not cut the second one short (its error would
// tell the caller a staged batch failed); planRestoreTimeout (5 s) does,
// should the database stop answering.
//
// The verity.leaderboard.submits counter counts its commands as staged,
// as SubmitTx's.
func (b *Board) SubmitBatchTx(ctx context.Context, tx outbox.Tx, cmds []Command) ([]Result, error) {
	if b.notFromNew() {
		return nil, errBoardNotFromNew()
	}
	out, err := b.submitBatchTx(ctx, tx, cmds)
	if err != nil {
		b.metrics.submitted(ctx, len(cmds), outcomeStaged, false, err)
		return out, err
	}
	dup := 0
	for _, r := range out {
		if r.Duplicate {
			dup++
		}
	}
	b.metrics.submitted(ctx, len(out)-dup, outcomeStaged, false, nil)
	b.metrics.submitted(ctx, dup, outcomeStaged, true, nil)
	return out, nil
}

func (b *Board) submitBatchTx(ctx context.Context, tx outbox.Tx, cmds []Command) ([]Result, error) {
	if deps.Missing(tx) {
		return nil, errNilTx("SubmitBatchTx")
	}
	if why := deps.NotInTransaction(tx); why != "" {
		return nil, errNotATransaction("SubmitBatchTx", why)
	}
	if len(cmds) == 0 {
		return nil, nil
	}
	in, err := b.prepareBatch(ctx, tx, cmds, false)
	if err != nil {
		return nil, err
	}
	args := []any{in.ids, in.users, in.deltas, b.cfg.Name, b.stream, false, b.channel}
	// A large batch must be planned for its arrays (see sendBatch). A Tx
	// may cache the statement (database/sql through outbox.SQLTx does),
	// which switches to the generic plan after five runs (2,000 commands:
	// 40 ms, then 530 ms), and the caller's session may force generic
	// plans: the statement runs with plan_cache_mode force_custom_plan, and
	// the caller's setting is put back after it.
	customPlan := len(in.sent) > preparedBatchMax
	if ptx, ok := tx.(pgx.Tx); ok && ptx.Conn() != nil && customPlan {
		// An unnamed statement is planned for its arguments only under
		// plan_cache_mode auto: the caller's session (or role) may force
		// generic plans. The simple protocol sends the values as text.
		switch ptx.Conn().Config().DefaultQueryExecMode {
		case pgx.QueryExecModeSimpleProtocol:
			customPlan = false
		case pgx.QueryExecModeCacheStatement:
			args = append([]any{pgx.QueryExecModeExec}, args...)
		}
	}
	var planMode, jitMode string
	if customPlan {
		if err := tx.QueryRow(ctx, forceCustomPlanSQL).Scan(&planMode, &jitMode, new(string), new(string)); err != nil {
			return nil, b.dbError(opSubmitBatchTx, err)
		}
	}
	var doc string
	err = tx.QueryRow(ctx, b.sql.submitBatchTx, args...).Scan(&doc)
	if customPlan {
		// Also after the statement failed: one that ctx stopped before it
		// was sent leaves tx usable, with the caller's settings changed.
		// Not cut short by ctx: the batch may be in tx now, and an error
		// here would tell the caller it failed. Bounded all the same: a
		// database that stops answering must not hold the call past every
		// deadline. After a failed statement the statement's error is the
		// one returned (in an aborted tx the restore fails too).
		restoreCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), planRestoreTimeout)
		rerr := tx.QueryRow(restoreCtx, restorePlanModeSQL, planMode, jitMode).Scan(new(string), new(string))
		cancel()
		if err == nil {
			err = rerr
		}
	}
	switch {
	case err == nil:
	case b.outboxIDClash(err):
		return nil, b.dbError(opSubmitBatchTx, err)
	case isUniqueViolation(err) && violatedTable(err) == b.cfg.OutboxTable:
		return nil, fmt.Errorf("leaderboard: submit batch: an event id is already used by another outbox writer (the transaction is aborted): %w (%w)", ErrIdempotencyConflict, err)
	case isUniqueViolation(err):
		return nil, &ConcurrentSubmitError{EventID: twinEventID(err, cmds, in.sent)}
	case isScoreRangeViolation(err):
		return nil, &ScoreOutOfRangeError{Index: -1}
	default:
		return nil, b.dbError(opSubmitBatchTx, err)
	}
	var rows []batchTxRow
	if err := json.Unmarshal([]byte(doc), &rows); err != nil {
		return nil, fmt.Errorf("leaderboard: submit batch: decoding the results: %w", err)
	}
	out := make([]Result, len(cmds))
	seen := make([]bool, len(in.sent))
	var conflict error
	conflictAt := 0
	for _, r := range rows {
		if r.Ord < 1 || int(r.Ord) > len(in.sent) || seen[r.Ord-1] {
			return nil, fmt.Errorf("leaderboard: submit batch: unexpected row number %d", r.Ord)
		}
		seen[r.Ord-1] = true
		i := in.sent[r.Ord-1]
		// A prior command that differs: the statement wrote nothing and
		// returned the prior rows only (see submitBatchCTEs). The first in
		// cmds' order is reported, as by SubmitBatch.
		if _, err := b.checkDuplicate(cmds[i], Result{Duplicate: r.Duplicate}, r.Board, r.User, r.Delta); err != nil {
			if conflict == nil || i < conflictAt {
				conflict, conflictAt = err, i
			}
			continue
		}
		out[i] = Result{Score: r.Score, Version: r.Version, Duplicate: r.Duplicate}
	}
	if conflict != nil {
		return nil, conflict
	}
	if len(rows) != len(in.sent) {
		return nil, fmt.Errorf("leaderboard: submit batch: %d results for %d commands", len(rows), len(in.sent))
	}
	in.copyRepeats(cmds, out)
	return out, nil
}

// batchTxRow is one element of submitBatchTxSQL's JSON array.
type batchTxRow struct {
	Ord       int64  `json:"o"`
	Duplicate bool   `json:"d"`
	Score     int64  `json:"s"`
	Version   int64  `json:"v"`
	Board     string `json:"b"`
	User      string `json:"u"`
	Delta     int64  `json:"x"`
}

// twinEventID returns the event id of the batch's commands (those at
// positions sent) that a unique violation of score_events names, or
// uuid.Nil when its detail names none (a server whose messages are
// translated still quotes the key's value).
func twinEventID(err error, cmds []Command, sent []int) uuid.UUID {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return uuid.Nil
	}
	for _, i := range sent {
		if strings.Contains(pgErr.Detail, cmds[i].EventID.String()) {
			return cmds[i].EventID
		}
	}
	return uuid.Nil
}

// batchOptions adapt submitBatch to Submit's groups.
type batchOptions struct {
	// everyState queues every command's resulting state in the outbox, as
	// Submit does, instead of each user's last one only.
	everyState bool
	// lockTimeout, when positive, bounds the statement's wait for any one
	// lock (PostgreSQL's lock_timeout, for this statement only).
	lockTimeout time.Duration
	// conn, when set, is the connection to run on instead of the pool's
	// next one (a Submit group acquires it before it decides who is in).
	conn *pgxpool.Conn
	// group is set for a Submit group, which applies each command on its
	// own after any conflict (submitGroup.apply): an event id the group
	// uses for two commands is then reported without looking up the
	// recorded command, a round trip whose failure would otherwise be
	// every caller's error.
	group bool
}

// batchQuerier is what sendBatch and locateOverflow run on:
// the pool or a connection taken from it.
type batchQuerier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

var (
	_ batchQuerier = (*pgxpool.Pool)(nil)
	_ batchQuerier = (*pgxpool.Conn)(nil)
)

// querier returns the connection opts hold, or else the pool.
func (b *Board) querier(opts batchOptions) batchQuerier {
	if opts.conn != nil {
		return opts.conn
	}
	return b.pool
}

// batchInput is a validated batch as its statement takes it: each event
// id once, at its first command's position.
type batchInput struct {
	// first maps an event id to its first position; later copies of the
	// same command take that command's result.
	first map[uuid.UUID]int
	// pgtype.UUID: pgx sends it in binary in either statement mode. A
	// uuid.UUID is a type QueryExecModeExec cannot map to a PostgreSQL
	// type, and strings made a cached statement fail to plan a binary
	// uuid[] on every call (an error built and dropped) before falling
	// back to text that PostgreSQL then parsed.
	ids    []pgtype.UUID
	users  []string
	deltas []int64
	sent   []int // position in cmds of each sent row
}

// prepareBatch validates cmds and gathers the batch's arrays. An event id
// used for two different commands fails the batch with batchConflict's
// error, read on q (unless group: see batchOptions.group).
func (b *Board) prepareBatch(ctx context.Context, q rowQuerier, cmds []Command, group bool) (batchInput, error) {
	in := batchInput{
		first:  make(map[uuid.UUID]int, len(cmds)),
		ids:    make([]pgtype.UUID, 0, len(cmds)),
		users:  make([]string, 0, len(cmds)),
		deltas: make([]int64, 0, len(cmds)),
		sent:   make([]int, 0, len(cmds)),
	}
	reused := -1 // first command whose event id an earlier one used for another command
	for i, cmd := range cmds {
		if err := b.validate(i, cmd); err != nil {
			return batchInput{}, err
		}
		if j, ok := in.first[cmd.EventID]; ok {
			if reused < 0 && (cmds[j].UserID != cmd.UserID || cmds[j].Delta != cmd.Delta) {
				reused = i
			}
			continue
		}
		in.first[cmd.EventID] = i
		in.ids, in.users, in.deltas = append(in.ids, binaryUUID(cmd.EventID)), append(in.users, cmd.UserID), append(in.deltas, cmd.Delta)
		in.sent = append(in.sent, i)
	}
	if reused >= 0 {
		earlier := cmds[in.first[cmds[reused].EventID]]
		if group { // never a caller's: the group falls back (see batchOptions.group)
			return batchInput{}, &IdempotencyConflictError{EventID: earlier.EventID, Board: b.cfg.Name, UserID: earlier.UserID, Delta: earlier.Delta, Attempted: cmds[reused], WithinBatch: true}
		}
		return batchInput{}, b.batchConflict(ctx, q, earlier, cmds[reused])
	}
	return in, nil
}

// copyRepeats gives each later copy of a command its first copy's result,
// as a duplicate.
func (in batchInput) copyRepeats(cmds []Command, out []Result) {
	for i, cmd := range cmds {
		if j := in.first[cmd.EventID]; j != i {
			out[i] = out[j]
			out[i].Duplicate = true
		}
	}
}

// submitBatch applies cmds in one statement.
func (b *Board) submitBatch(ctx context.Context, cmds []Command, opts batchOptions) ([]Result, error) {
	if len(cmds) == 0 {
		return nil, nil
	}
	in, err := b.prepareBatch(ctx, b.querier(opts), cmds, opts.group)
	if err != nil {
		return nil, err
	}
	sent, ids, users, deltas := in.sent, in.ids, in.users, in.deltas

	out := make([]Result, len(cmds))
	// A twin committed after the statement's snapshot aborts it with a
	// unique violation on score_events; nothing was written, and the next
	// attempt sees the twin as a prior event. Every such failure makes
	// one more of the batch's ids prior, so at most one attempt per id
	// fails that way. A deadlock (event ids reused for other commands by a
	// transaction that holds them in another order) is retried as well: the
	// statement that lost it released everything.
	for twins, deadlocks := 0, 0; ; {
		err = b.submitBatchOnce(ctx, cmds, sent, ids, users, deltas, opts, out)
		switch {
		case err == nil:
		case b.outboxIDClash(err):
			return nil, b.dbError("submit batch", err)
		case isUniqueViolation(err) && violatedTable(err) == b.cfg.OutboxTable:
			// score_events took the id, the outbox did not: another
			// writer of the same outbox holds it (see submitBatchSQL).
			return nil, fmt.Errorf("leaderboard: submit batch: an event id is already used by another outbox writer: %w (%w)", ErrIdempotencyConflict, err)
		case isUniqueViolation(err) && twins < len(sent) && ctx.Err() == nil:
			twins++
			continue
		case isUniqueViolation(err) && ctx.Err() != nil:
			// A twin committed meanwhile, and the caller gave up before
			// the retry that would report it: nothing was written.
			return nil, fmt.Errorf("leaderboard: submit batch: %w (a twin committed meanwhile: %w)", ctx.Err(), err)
		case isUniqueViolation(err):
			return nil, b.dbError("submit batch", err)
		case isDeadlock(err) && deadlocks < batchDeadlockRetries && ctx.Err() == nil:
			deadlocks++
			continue
		}
		break
	}
	if err != nil {
		return nil, err
	}
	in.copyRepeats(cmds, out)
	return out, nil
}

// batchConflict returns the error for a batch that uses an event id for
// two different commands: earlier, the first with the id, and later, the
// first that differs from it. The command recorded under the id, when there
// is one (either of them, or another, of this board or another), is the
// one the error describes: the batch's copies say nothing of what the
// database holds. The refused command is the first of the two that differs
// from it (when earlier is the recorded one, every copy before later is
// too). With none recorded, the error describes earlier and refuses later.
func (b *Board) batchConflict(ctx context.Context, q rowQuerier, earlier, later Command) error {
	var (
		board, user           string
		delta, score, version int64
	)
	err := q.QueryRow(ctx, b.sql.lookupEvent, binaryUUID(earlier.EventID)).Scan(&board, &user, &delta, &score, &version)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return &IdempotencyConflictError{EventID: earlier.EventID, Board: b.cfg.Name, UserID: earlier.UserID, Delta: earlier.Delta, Attempted: later, WithinBatch: true}
	case err != nil:
		return b.dbError(fmt.Sprintf("submit batch: reading the command recorded for event %s", earlier.EventID), err)
	}
	attempted := earlier
	if board == b.cfg.Name && user == earlier.UserID && delta == earlier.Delta {
		attempted = later
	}
	return &IdempotencyConflictError{EventID: earlier.EventID, Board: board, UserID: user, Delta: delta, Attempted: attempted}
}

func (b *Board) submitBatchOnce(ctx context.Context, cmds []Command, sent []int, ids []pgtype.UUID, users []string, deltas []int64, opts batchOptions, out []Result) error {
	if opts.conn == nil {
		// The connection first, as Submit takes it: a pool that cannot
		// give one (its BeforeConnect, AfterConnect or PrepareConn hook
		// refused) sent nothing, which a failed query would not tell.
		conn, err := b.pool.Acquire(ctx)
		if err != nil {
			return b.dbError("submit batch", err)
		}
		defer conn.Release()
		opts.conn = conn
	}
	rows, finish, err := b.sendBatch(ctx, len(sent), opts, ids, users, deltas)
	if err != nil {
		return b.mapBatchError(ctx, err, cmds, sent, opts)
	}
	// finish gives the connection back and is idempotent: the paths to
	// mapBatchError call it first (its overflow probe may need the pool's
	// last connection), and this defer covers the others.
	defer func() { _ = finish() }()
	var conflict *IdempotencyConflictError
	conflictAt, seen, applied := 0, 0, 0
	for rows.Next() {
		var (
			ord         int64
			res         Result
			board, user string
			delta       int64
		)
		if err := rows.Scan(&ord, &res.Duplicate, &res.Score, &res.Version, &board, &user, &delta); err != nil {
			return fmt.Errorf("leaderboard: submit batch: %w", err)
		}
		if ord < 1 || int(ord) > len(sent) {
			return fmt.Errorf("leaderboard: submit batch: unexpected row number %d", ord)
		}
		i := sent[ord-1]
		cmd := cmds[i]
		// The first conflict in cmds' order, whatever order the plan
		// returns the rows in (a merge join returns them by event id).
		if res.Duplicate && (conflict == nil || i < conflictAt) && (board != b.cfg.Name || user != cmd.UserID || delta != cmd.Delta) {
			conflict, conflictAt = &IdempotencyConflictError{EventID: cmd.EventID, Board: board, UserID: user, Delta: delta, Attempted: cmd}, i
		}
		out[i] = res
		seen++
		if !res.Duplicate {
			applied++
		}
	}
	if err := rows.Err(); err != nil {
		_ = finish()
		return b.mapBatchError(ctx, err, cmds, sent, opts)
	}
	if err := finish(); err != nil { // the commit's outcome, for a pipeline
		return b.mapBatchError(ctx, err, cmds, sent, opts)
	}
	// The statement ran in autocommit and succeeded: whatever it applied is
	// committed (a conflict applies nothing). Wake the relays.
	if applied > 0 {
		b.notifier.Notify()
	}
	if conflict != nil {
		return conflict
	}
	if seen != len(sent) {
		return fmt.Errorf("leaderboard: submit batch: %d results for %d commands", seen, len(sent))
	}
	return nil
}

// sendBatch sends submitBatchSQL for n commands and returns its rows, and
// finish, which closes them and whatever else holds the connection: once
// the rows are read, the statement has committed when it returns nil. It
// must be called on every path; calls after the first return the first's
// error.
//
// Large batches go as QueryExecModeExec: the statement is sent unnamed, so
// PostgreSQL plans it for the actual arrays every time. A cached prepared
// statement switches to a generic plan after five runs, which cannot see
// the array sizes and joins the CTEs with nested loops: about 6x slower at
// 1,000 commands. Small ones (Submit's groups) take the cached statement:
// there the nested loops cost nothing and planning would be about half the
// statement's time. With a lock timeout, a set_config precedes the
// statement in the same pipeline, before one Sync: both run in one
// implicit transaction, which the setting does not outlive. A pipeline
// runs in the pool's default mode (pgx's default caches the statement)
// whatever its size; only Submit's groups use one, at most
// MaxSubmitsPerStatement commands. A group larger than preparedBatchMax
// (MaxSubmitsPerStatement raised above its default) would run on the
// generic plan: its set_config also sets plan_cache_mode to
// force_custom_plan for that transaction, so PostgreSQL plans it for its
// arrays as it plans an unnamed statement: with groups of 256 (512
// clients, MaxSubmitsPerStatement 256, one statement at a time) Submit ran
// 31,600-32,900 commands/s, against 16,800-17,300 on the generic plan.
// One round trip in every case. A pool whose DefaultQueryExecMode does not
// cache statements (behind a transaction-pooling proxy, where a statement
// prepared on one server connection is missing on the next) runs every
// batch in that mode. An unnamed statement is planned for its arrays only
// while plan_cache_mode is auto, and a role, a database or a proxy's other
// client may have set force_generic_plan (2,000 commands then took
// 0.7-0.8 s instead of 45-55 ms): a large batch without a lock timeout
// sends customPlanSQL before it, in the same way, unless the pool sends
// arguments inline (the simple protocol), which PostgreSQL plans as they
// are.
func (b *Board) sendBatch(ctx context.Context, n int, opts batchOptions, ids []pgtype.UUID, users []string, deltas []int64) (pgx.Rows, func() error, error) {
	args := []any{ids, users, deltas, b.cfg.Name, b.stream, opts.everyState}
	customPlan := n > preparedBatchMax && !b.simpleProtocol
	if opts.lockTimeout <= 0 && !customPlan {
		if b.cachesStatements {
			mode := pgx.QueryExecModeExec
			if n <= preparedBatchMax {
				mode = pgx.QueryExecModeCacheStatement
			}
			args = append([]any{mode}, args...)
		}
		rows, err := b.querier(opts).Query(ctx, b.sql.submitBatch, args...)
		if err != nil {
			return nil, nil, err
		}
		return rows, func() error { rows.Close(); return rows.Err() }, nil
	}
	batch := &pgx.Batch{}
	switch {
	case opts.lockTimeout <= 0:
		batch.Queue(customPlanSQL)
	case n > preparedBatchMax:
		batch.Queue(setLockTimeoutCustomPlanSQL, strconv.FormatInt(opts.lockTimeout.Milliseconds(), 10)+"ms")
	default:
		batch.Queue(setLockTimeoutSQL, strconv.FormatInt(opts.lockTimeout.Milliseconds(), 10)+"ms")
	}
	batch.Queue(b.sql.submitBatch, args...)
	results := b.querier(opts).SendBatch(ctx, batch)
	if _, err := results.Exec(); err != nil {
		_ = results.Close()
		return nil, nil, err
	}
	rows, err := results.Query()
	if err != nil {
		_ = results.Close()
		return nil, nil, err
	}
	return rows, func() error { rows.Close(); return results.Close() }, nil
}

func (b *Board) mapBatchError(ctx context.Context, err error, cmds []Command, sent []int, opts batchOptions) error {
	switch {
	case isUniqueViolation(err):
		return err
	case isScoreRangeViolation(err):
		return b.locateOverflow(ctx, b.querier(opts), cmds, sent)
	}
	return outcomeUnknown(b.dbError("submit batch", err))
}

// locateOverflow finds which command of a refused batch would have left
// the score range, by replaying the batch in memory over the current
// scores. The constraint violation itself does not say.
func (b *Board) locateOverflow(ctx context.Context, q batchQuerier, cmds []Command, sent []int) error {
	unknown := &ScoreOutOfRangeError{Index: -1}
	users := make([]string, 0, len(sent))
	ids := make([]string, 0, len(sent))
	for _, i := range sent {
		users, ids = append(users, cmds[i].UserID), append(ids, cmds[i].EventID.String())
	}
	rows, err := q.Query(ctx, b.sql.overflowProbe, b.cfg.Name, users, ids)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			// Not a concurrent change: the caller gave up before the
			// look-up. Both are true, and both match.
			return fmt.Errorf("%w (not located: %w)", unknown, cerr)
		}
		return unknown
	}
	scores := make(map[string]int64, len(users))
	prior := make(map[string]bool)
	for rows.Next() {
		var key string
		var score int64
		var isEvent bool
		if rows.Scan(&key, &score, &isEvent) != nil {
			rows.Close()
			return unknown
		}
		if isEvent {
			prior[key] = true
		} else {
			scores[key] = score
		}
	}
	if rows.Err() != nil {
		return unknown
	}
	for _, i := range sent {
		cmd := cmds[i]
		if prior[cmd.EventID.String()] {
			continue
		}
		next := scores[cmd.UserID] + cmd.Delta // |score|, |delta| <= 2^53: no overflow
		if next < MinScore || next > MaxScore {
			return &ScoreOutOfRangeError{Index: i, UserID: cmd.UserID, Delta: cmd.Delta}
		}
		scores[cmd.UserID] = next
	}
	return unknown
}

// outboxIDClash reports a unique violation of the outbox's primary key
// (its ids reset), not of an event id: no writer used the event id.
func (b *Board) outboxIDClash(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.TableName == b.cfg.OutboxTable &&
		strings.HasSuffix(pgErr.ConstraintName, "_pkey")
}

// isUniqueViolation reports a unique-key violation (SQLSTATE 23505).
func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}

// preparedBatchMax is the largest batch sent as a cached prepared
// statement (see sendBatch).
const preparedBatchMax = MaxSubmitsPerStatementDefault

// planRestoreTimeout bounds SubmitBatchTx's statement that puts the
// caller's plan_cache_mode back, which ctx does not cut short.
const planRestoreTimeout = 5 * time.Second

// batchDeadlockRetries bounds how often SubmitBatch runs its statement
// again after losing a deadlock (counted apart from the twins it meets).
const batchDeadlockRetries = 3

// isLockTimeout reports PostgreSQL's lock_not_available (55P03), which a
// statement with a lock_timeout gets when a lock wait outlasts it.
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// isDeadlock reports PostgreSQL's deadlock_detected (40P01).
func isDeadlock(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "40P01"
}

// violatedTable returns the table of a constraint violation ("" if the
// server did not say). submitSQL inserts into score_events before the
// outbox, so a twin always violates score_events' key first.
func violatedTable(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.TableName
	}
	return ""
}

// isVersionOverflow reports a user whose version is at int64's maximum:
// the statements set it to NULL rather than overflow (which 22003 would
// report as a score out of range), and NOT NULL refuses it.
func isVersionOverflow(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23502" && pgErr.ColumnName == "version"
}

// isScoreRangeViolation reports a violation of the score range constraints
// (SQLSTATE 23514 on one of ours) or an integer overflow (22003).
func isScoreRangeViolation(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "22003":
		return true
	case "23514":
		return pgErr.ConstraintName == "verity_user_scores_score_range" ||
			pgErr.ConstraintName == "verity_score_events_score_range"
	}
	return false
}
