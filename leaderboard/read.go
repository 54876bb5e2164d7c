package leaderboard

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/clusterpin"
	"github.com/verity-go/verity/internal/lograte"
	"github.com/verity-go/verity/projection"
)

// MaxPageSize bounds the n of Top, Page and Authoritative and the
// neighbourhood of Around.
const MaxPageSize = 1000

// MaxAtLeast bounds the users one read can pass to AtLeast: every
// requirement is checked on each poll of the projection, and in the script
// or statement that reads the answer. A read with more (distinct users with
// a version above 0) fails with ErrInvalidReadOption.
const MaxAtLeast = 64

// Entry is one line of a ranking.
type Entry struct {
	UserID string
	Score  int64
	// Rank is the 1-based position in the ranking order: score descending,
	// then user id ascending by bytes. Ties in score therefore get distinct
	// ranks, ordered by user id; a product that wants shared ranks can
	// derive them from Score.
	Rank int64
}

// Source says which store answered a read.
type Source string

const (
	// SourceRedis means the answer came from the Redis projection.
	SourceRedis Source = "redis"
	// SourcePostgres means the answer came from PostgreSQL, the source of
	// truth; it is exact as of the read.
	SourcePostgres Source = "postgres"
)

// Freshness describes how current an answer is.
type Freshness struct {
	// Source is the store that answered.
	Source Source
	// ProjectedThrough is a time before which every committed change of the
	// board is reflected in the answer: as of the last lag measurement, the
	// creation time of the board's oldest unprojected change, or, when there
	// was none, the time of that measurement. For PostgreSQL answers it is
	// the time the read's statement was sent, just before PostgreSQL took
	// the snapshot the answer reflects. Zero when the lag could not be
	// measured.
	ProjectedThrough time.Time
	// Lag is how long the oldest unprojected change has been waiting, by
	// the database clock: the age of the board's oldest outbox row that is
	// pending or dead-lettered (a dead letter counts from its original
	// creation until it is replayed or deleted, since Redis may never get
	// it, or until a newer version of its user has reached Redis). When
	// there was none at the last measurement, Lag is 0 while that
	// measurement is younger than Config.LagProbeInterval and its age
	// after that (a probe under way can take longer, and a change may have
	// been waiting since), so Lag understates the true lag by less than
	// LagProbeInterval, plus, for a change whose transaction was already
	// open when the measurement was taken (a change counts from its
	// transaction's start; see Board.SubmitTx), how long it had been open
	// then. A measurement's age counts from when its query was sent, by the
	// process's monotonic clock, or by its wall clock where that says longer
	// (a host suspend stops the monotonic clock, not the wall clock). 0 for PostgreSQL answers; negative when it could not be
	// measured: PostgreSQL could not be asked, or the probe found a change
	// not yet projected dated after the database clock, which therefore
	// stepped back since the change was written (an NTP step, a VM
	// resumed, a failover to a host whose clock lags), so that neither its
	// age nor that of changes written before the step is known; reads see
	// -1 until every change dated up to it is projected (the clock passing
	// it does not make its age known). A step back that leaves no change
	// dated after the clock is seen the same way when the database clock
	// advanced less than this process's monotonic clock (by more than an
	// eighth, which clock slewing can account for) between two
	// measurements on one connection (a pool's connections may reach
	// servers whose clocks differ); a Board whose first measurement
	// follows the step, or whose measurements after it run on other
	// connections, cannot tell, and understates the lag by the step. Lag sees
	// the outbox only, not entries Redis itself lost (see Reading in the
	// package documentation). Lag and ProjectedThrough are measured in the
	// board's pool: on a standby they leave out what the primary committed
	// and the standby has not replayed yet (see "A pool on a standby" in
	// the package documentation).
	Lag time.Duration
	// Unverified is set, with Lag -1, when Config.RequireVerifiedProjection
	// is on and Redis, looked at less than Config.LagProbeInterval before
	// the read or during it, held no record of a Verify since it last lost
	// the board's keys (or could not be read), or the record names another
	// database than the one the lag probe found (a failover, a restore; see
	// "When PostgreSQL goes back"): the projection may be missing entries,
	// or show scores PostgreSQL no longer has.
	Unverified bool
	// AtLeastMet reports whether the answer reflects every version the
	// read asked for with AtLeast (true when it asked for none): Redis
	// held each of them in the script that read the answer, or PostgreSQL
	// held each of them in the snapshot the answer was read from. It is
	// false when ServeStale answered from Redis before the projection
	// reached them all, and when FallbackToPostgres answered from
	// PostgreSQL while a version asked for is not committed there either
	// (the transaction that submitted it rolled back or has not committed
	// yet). A version is the count of the user's committed commands, so
	// the number of a command rolled back goes to the user's next one, and
	// once that commits it meets AtLeast of the rolled-back one's Result.
	AtLeastMet bool
}

// Ranking is a page of entries with its freshness.
type Ranking struct {
	Entries []Entry
	// Next is the cursor of the following page for Page, or "" when this
	// page reached the end of the board.
	Next      string
	Freshness Freshness
}

// ReadOption adjusts one read.
type ReadOption func(*readOptions)

type readOptions struct {
	atLeast    []requirement // as given, in order
	policy     ReadPolicy
	forceStale bool // tests: treat the projection as stale
}

// requirement is one AtLeast: user's version must have reached version.
type requirement struct {
	user    string
	version int64
}

// AtLeast asks for read-your-writes: the answer must reflect at least
// version of user (the Version of the Result that Submit returned). A read
// may pass several, up to MaxAtLeast users (a transaction that changed the
// scores of both players of a match): the answer must reflect all of them,
// and two for the same user ask for the higher version. A version of 0 or
// less asks for nothing. When the projection has not reached them all, the
// read waits up to Config.ReadYourWritesTimeout; if it is still behind, the
// read policy decides (FallbackToPostgres reads PostgreSQL, FailClosed
// returns a *StaleError, ServeStale answers from Redis with
// Freshness.AtLeastMet false, or, when Rank or Around finds the user it
// looked up not in Redis, a *StaleError instead of ErrUserNotFound, whether
// or not that user is among the ones required: an error carries no
// Freshness to say the answer was unmet); a *StaleError names the
// first requirement, in the order of the options, still unmet. Redis's
// answer is read in one script with the versions, which decide
// AtLeastMet: if Redis has gone back to an older state since the wait saw
// them (a failover that lost the newest writes), the policy decides as for
// a wait that ran out. A board
// whose Config.VersionBuckets differs from the count the projection is
// stored with cannot find the versions, nor can any board once the
// projection lost its layout key while keeping its sorted set but not its
// unbucketed version hash (a DEL, an eviction; the gate then refuses every
// writer until the key is set again or Rebuild runs): the read fails at
// once, under every policy, with a *projection.LayoutMismatchError
// (projection.ErrLayoutMismatch; Stored is -1 for a lost layout key). A
// projection that kept its unbucketed version hash reads, as the gate
// reads it, as stored with 0 buckets.
func AtLeast(user string, version int64) ReadOption {
	return func(o *readOptions) { o.atLeast = append(o.atLeast, requirement{user, version}) }
}

// WithPolicy overrides Config.ReadPolicy for one read. An unknown policy,
// the zero value included, fails the read with ErrInvalidReadOption.
func WithPolicy(p ReadPolicy) ReadOption {
	return func(o *readOptions) { o.policy = p }
}

var (
	//go:embed page.lua
	pageLua    string
	pageScript = redis.NewScript(pageLua)

	//go:embed around.lua
	aroundLua    string
	aroundScript = redis.NewScript(aroundLua)

	//go:embed top.lua
	topLua string
	//go:embed versions.lua
	versionsLua string

	// The scripts of reads with AtLeast; reads without keep the commands
	// above.
	topAtLeastScript    = withVersions(topLua)
	pageAtLeastScript   = withVersions(pageLua)
	aroundAtLeastScript = withVersions(aroundLua)
)

// withVersions returns read script body run by versions.lua, which also
// reads the versions the read requires, in the same atomic step: body
// becomes a function of its own KEYS and ARGV, which versions.lua calls.
func withVersions(body string) *redis.Script {
	return redis.NewScript("local function read(KEYS, ARGV)\n" + body + "\nend\n" + versionsLua)
}

// Top returns the first n entries of the board. It is Page with no cursor.
func (b *Board) Top(ctx context.Context, n int, opts ...ReadOption) (Ranking, error) {
	return b.Page(ctx, "", n, opts...)
}

// Page returns up to n entries following cursor ("" for the first page).
// Ranking.Next is the cursor of the next page. Cursors are keyset
// positions: a page starts right after the (score, user) where the previous
// one ended, so concurrent score changes never make a page repeat or skip
// an entry that kept its place, and a cursor works against Redis and
// PostgreSQL alike, also after a member of the sorted set that no user id
// can be (invalid UTF-8, a NUL byte: a foreign writer's, which Redis reads
// serve like any member). A cursor of another board (another Name, Schema
// or KeyPrefix) returns ErrInvalidCursor, and so does a cursor issued
// before an upgrade that changed the cursor format: the client starts
// again from the first page.
func (b *Board) Page(ctx context.Context, cursorText string, n int, opts ...ReadOption) (Ranking, error) {
	if b.notFromNew() {
		return Ranking{}, errBoardNotFromNew()
	}
	if n < 1 || n > MaxPageSize {
		return Ranking{}, ErrInvalidLimit
	}
	var after *cursor
	if cursorText != "" {
		c, err := b.decodeCursor(cursorText)
		if err != nil {
			return Ranking{}, err
		}
		after = &c
	}
	var entries []Entry
	fresh, err := b.read(ctx, opts, false,
		func(ctx context.Context, need []requirement) (first int, err error) {
			entries, first, err = b.redisPage(ctx, after, n+1, need)
			return first, err
		},
		func(ctx context.Context, db querier, need []requirement) (met bool, err error) {
			entries, met, err = b.pgPage(ctx, db, after, n+1, need)
			return met, err
		},
	)
	if err != nil {
		return Ranking{}, err
	}
	return b.ranking(entries, n, fresh), nil
}

// Rank returns user's entry. It returns a *UserNotFoundError (matching
// ErrUserNotFound) when the user has no score in the store that answered;
// its Freshness describes that answer, as the Freshness returned with an
// entry would: from a lagging projection, "no score" may only mean "not
// projected yet".
func (b *Board) Rank(ctx context.Context, user string, opts ...ReadOption) (Entry, Freshness, error) {
	if b.notFromNew() {
		return Entry{}, Freshness{}, errBoardNotFromNew()
	}
	var entry Entry
	fresh, err := b.read(ctx, opts, !storableUserID(user),
		func(ctx context.Context, need []requirement) (first int, err error) {
			entry, first, err = b.redisRank(ctx, user, need)
			return first, err
		},
		func(ctx context.Context, db querier, need []requirement) (met bool, err error) {
			entry, met, err = b.pgRank(ctx, db, user, need)
			return met, err
		},
	)
	if err != nil {
		return Entry{}, Freshness{}, withUser(err, user)
	}
	return entry, fresh, nil
}

// withUser names user in err when it is a *UserNotFoundError.
func withUser(err error, user string) error {
	// errors.As: a read whose caller gave up as the answer came joins
	// ctx's error to it.
	if nf := (*UserNotFoundError)(nil); errors.As(err, &nf) {
		nf.UserID = user
	}
	return err
}

// Around returns user's entry with up to n neighbours on each side, in
// ranking order. It returns a *UserNotFoundError (matching ErrUserNotFound,
// with the answer's Freshness) when the user has no score in the store
// that answered.
func (b *Board) Around(ctx context.Context, user string, n int, opts ...ReadOption) (Ranking, error) {
	if b.notFromNew() {
		return Ranking{}, errBoardNotFromNew()
	}
	if n < 0 || n > MaxPageSize {
		return Ranking{}, invalidNeighboursError{}
	}
	var entries []Entry
	fresh, err := b.read(ctx, opts, !storableUserID(user),
		func(ctx context.Context, need []requirement) (first int, err error) {
			entries, first, err = b.redisAround(ctx, user, n, need)
			return first, err
		},
		func(ctx context.Context, db querier, need []requirement) (met bool, err error) {
			entries, met, err = b.pgAround(ctx, db, user, n, need)
			return met, err
		},
	)
	if err != nil {
		return Ranking{}, withUser(err, user)
	}
	return Ranking{Entries: entries, Freshness: fresh}, nil
}

// Authoritative returns the first n entries of the board from PostgreSQL,
// the source of truth, never from Redis, read in one snapshot.
//
// USE THIS, AND ONLY THIS, FOR PAYOUTS, PRIZES AND ANY OTHER IRREVERSIBLE
// DECISION. The Redis projection may lag, may have lost keys or may have
// been edited by hand until the reconciler repairs it; it is a read model
// for display, never the authority on who won.
func (b *Board) Authoritative(ctx context.Context, n int) ([]Entry, error) {
	if b.notFromNew() {
		return nil, errBoardNotFromNew()
	}
	if n < 1 || n > MaxPageSize {
		return nil, ErrInvalidLimit
	}
	entries, _, err := b.pgPage(ctx, b.pool, nil, n, nil)
	if err != nil {
		return nil, err
	}
	return entries, nil
}

// Freshness reports the projection's current freshness without reading
// it: the figure to export as a metric and alert on (with the outbox's own
// Stats). It is measured at most once per Config.LagProbeInterval.
// AtLeastMet is true: nothing was asked for. On a board used before
// Migrate the lag cannot be measured: Lag is -1 (reads fail with
// ErrNotMigrated), as on a Board that New did not make.
func (b *Board) Freshness(ctx context.Context) Freshness {
	if b.notFromNew() {
		return Freshness{Lag: -1, AtLeastMet: true}
	}
	fresh, _ := b.freshness(ctx)
	fresh.AtLeastMet = true
	return fresh
}

// storableUserID reports whether user could have been submitted: ids
// PostgreSQL cannot store cannot have a score, and must not reach SQL; nor
// can one longer than MaxUserIDLengthLimit, the most any Config allows,
// which must not reach Redis either: one over its proto-max-bulk-len makes
// Redis close the connection.
func storableUserID(user string) bool {
	return user != "" && len(user) <= MaxUserIDLengthLimit && utf8.ValidString(user) && strings.IndexByte(user, 0) < 0
}

// ranking trims a page fetched with one extra entry and sets Next.
func (b *Board) ranking(entries []Entry, n int, fresh Freshness) Ranking {
	r := Ranking{Entries: entries, Freshness: fresh}
	if len(entries) > n {
		r.Entries = entries[:n]
		last := r.Entries[n-1]
		r.Next = b.encodeCursor(cursor{score: last.Score, user: last.UserID})
	}
	return r
}

// pgReader reads an answer from PostgreSQL on db and reports whether
// PostgreSQL held every version of need in the snapshot the answer was
// read from (true when need is empty), found in the same statement.
type pgReader func(ctx context.Context, db querier, need []requirement) (met bool, err error)

// redisReader reads an answer from Redis and, when need is not empty, the
// projected versions of need's users in the same script, and returns the
// index in need of the first requirement Redis had not reached then, -1
// when it had reached them all (and without requirements), with
// ErrUserNotFound too. Checked in a separate round trip, the versions could
// describe another state than the answer's: Redis may go back to an older
// one in between (a failover to a replica that missed the newest writes).
type redisReader func(ctx context.Context, need []requirement) (first int, err error)

// read runs one read under the policy, and counts it: fromRedis when the
// projection is fresh enough (or the policy serves stale answers),
// fromPostgres, on the connection pgRead gives it, when the policy falls
// back. noSuchUser marks a lookup of a user id no store can hold (see
// storableUserID): once the options are found valid, it is
// ErrUserNotFound without reading. With ErrUserNotFound, the Freshness's
// Source names the store that answered (none for noSuchUser), for the
// reads counter; the public reads return a zero Freshness with every
// error, this one included.
//
// Invalid options are refused before anything is read, and not counted,
// like an invalid limit or cursor: the caller's mistake is not an outage
// (outcome=error) of the board.
func (b *Board) read(ctx context.Context, opts []ReadOption, noSuchUser bool, fromRedis redisReader, fromPostgres pgReader) (Freshness, error) {
	o, need, err := b.readOptions(opts)
	if err != nil {
		return Freshness{}, err
	}
	fresh, err := b.readUnderPolicy(ctx, o, need, noSuchUser, fromRedis, fromPostgres)
	err = withCallerEnded(ctx, err)
	// An i/o timeout at the caller's own deadline (go-redis with
	// ContextTimeoutEnabled and no retry left) is ctx's error, as the
	// policies already take it: say so to errors.Is.
	if errors.Is(err, os.ErrDeadlineExceeded) && !errors.Is(err, context.DeadlineExceeded) {
		if cerr := callerEnded(ctx, err); cerr != nil {
			err = fmt.Errorf("%w: %w", err, cerr)
		}
	}
	b.metrics.read(ctx, fresh, err)
	return fresh, err
}

// readOptions applies opts over the board's defaults and returns them
// with their requirements (see requirements), or an error matching
// ErrInvalidReadOption.
func (b *Board) readOptions(opts []ReadOption) (readOptions, []requirement, error) {
	o := readOptions{policy: b.cfg.ReadPolicy}
	for _, opt := range opts {
		if opt == nil {
			return o, nil, fmt.Errorf("%w: a nil ReadOption", ErrInvalidReadOption)
		}
		opt(&o)
	}
	// An unknown policy must not fall through to ServeStale: a fail-closed
	// caller whose policy field was left unset would get stale answers.
	if o.policy < ServeStale || o.policy > FailClosed {
		return o, nil, fmt.Errorf("%w: WithPolicy(%s) is unknown; use ServeStale, FallbackToPostgres or FailClosed", ErrInvalidReadOption, o.policy)
	}
	need, err := b.requirements(o.atLeast)
	if err != nil {
		return o, nil, err
	}
	return o, need, nil
}

func (b *Board) readUnderPolicy(ctx context.Context, o readOptions, need []requirement, noSuchUser bool, fromRedis redisReader, fromPostgres pgReader) (Freshness, error) {
	if noSuchUser {
		return Freshness{}, &UserNotFoundError{}
	}
	fallback := func() (Freshness, error) {
		// PostgreSQL answers with what is committed: a version asked for
		// may not be (its transaction rolled back, or has not committed
		// yet), which the statement itself checks, in its own snapshot.
		var met bool
		sent, err := b.pgRead(ctx, func(ctx context.Context, db querier) (err error) {
			met, err = fromPostgres(ctx, db, need)
			return err
		})
		fresh := Freshness{Source: SourcePostgres, ProjectedThrough: sent, AtLeastMet: met}
		if err != nil {
			if errors.Is(err, ErrUserNotFound) {
				return Freshness{Source: SourcePostgres}, &UserNotFoundError{Freshness: fresh}
			}
			return Freshness{}, err
		}
		return fresh, nil
	}

	// The wait decides when to read Redis; the versions read with the
	// answer decide whether it meets them.
	if len(need) > 0 {
		first, err := b.waitForVersions(ctx, need)
		if err != nil {
			// A layout mismatch is this board's misconfiguration, not a
			// Redis failure: refused under every policy, as the Worker is.
			// Nor is the caller's own ctx ending one to fall back from; a
			// fallback is logged, as from the Redis read below.
			if o.policy != FallbackToPostgres || errors.Is(err, projection.ErrLayoutMismatch) || callerEnded(ctx, err) != nil {
				return Freshness{}, err
			}
			b.warn(ctx, &b.logs.fallback, "leaderboard: Redis read failed; answering from PostgreSQL", err)
			return fallback()
		}
		if first >= 0 {
			switch o.policy {
			case FallbackToPostgres:
				return fallback()
			case FailClosed:
				fresh, notMigrated := b.freshness(ctx)
				if err := ctx.Err(); err != nil {
					return Freshness{}, err // as below: an unmeasured lag
				}
				if notMigrated != nil {
					return Freshness{}, notMigrated
				}
				return Freshness{}, b.unmetError(fresh, need[first])
			}
		}
	}

	fresh, notMigrated := b.freshness(ctx)
	if err := ctx.Err(); err != nil {
		// A lag the caller's own cancellation left unmeasured is not
		// staleness: report the cancellation, under every policy.
		return Freshness{}, err
	}
	// A board used before Migrate has no projection to serve, nor to refuse
	// as stale: an empty page would hide the mistake. FallbackToPostgres
	// asks PostgreSQL, whose statements report it themselves (and answer
	// as soon as Migrate has run).
	if notMigrated != nil && o.policy != FallbackToPostgres {
		return Freshness{}, notMigrated
	}
	if fresh.Lag < 0 || fresh.Lag > b.cfg.MaxLag || o.forceStale {
		switch o.policy {
		case FallbackToPostgres:
			return fallback()
		case FailClosed:
			return Freshness{}, &StaleError{Lag: fresh.Lag, MaxLag: b.cfg.MaxLag, Unverified: fresh.Unverified}
		}
	}
	first, err := fromRedis(ctx, need)
	if err != nil && !errors.Is(err, ErrUserNotFound) {
		if errors.Is(err, projection.ErrLayoutMismatch) {
			return Freshness{}, err // as from the wait
		}
		if o.policy == FallbackToPostgres && callerEnded(ctx, err) == nil {
			b.warn(ctx, &b.logs.fallback, "leaderboard: Redis read failed; answering from PostgreSQL", err)
			return fallback()
		}
		return Freshness{}, err
	}
	fresh.AtLeastMet = first < 0
	if first >= 0 {
		// Redis's answer lacks a version asked for: the wait timed out
		// (ServeStale), or Redis went back to an older state since the
		// wait saw them all.
		switch o.policy {
		case FallbackToPostgres:
			return fallback()
		case FailClosed:
			return Freshness{}, b.unmetError(fresh, need[first])
		}
		if errors.Is(err, ErrUserNotFound) {
			// "No score" could deny a score the caller just saved, and an
			// error has no Freshness to say the answer was unmet, so even a
			// user read who was not among the ones required gets the
			// StaleError.
			return Freshness{}, b.unmetError(fresh, need[first])
		}
	}
	if err != nil { // ErrUserNotFound
		return Freshness{Source: SourceRedis}, &UserNotFoundError{Freshness: fresh}
	}
	return fresh, nil
}

// unmetError is the *StaleError of a read whose requirement r Redis had not
// reached, with the lag of fresh. An unverified board may never receive the
// version again (the worker delivered it before Redis lost it): the error
// says so.
func (b *Board) unmetError(fresh Freshness, r requirement) *StaleError {
	unverified := b.cfg.RequireVerifiedProjection && fresh.Unverified
	return &StaleError{Lag: fresh.Lag, MaxLag: b.cfg.MaxLag, UserID: r.user, Version: r.version, Unverified: unverified}
}

// requirements checks the AtLeast options of a read and returns them
// without the ones that ask for nothing (a version of 0 or less), one per
// user (the highest version asked for it) in the order the users first
// appear. It refuses an unstorable user id, and more than MaxAtLeast
// users, with ErrInvalidReadOption.
func (b *Board) requirements(given []requirement) ([]requirement, error) {
	var need []requirement
	for _, r := range given {
		if r.version <= 0 {
			continue
		}
		if reason := b.userIDProblem(r.user); reason != "" {
			return nil, fmt.Errorf("%w: AtLeast user id %s", ErrInvalidReadOption, reason)
		}
		i := 0
		for i < len(need) && need[i].user != r.user {
			i++
		}
		switch {
		case i < len(need):
			need[i].version = max(need[i].version, r.version)
		case len(need) == MaxAtLeast:
			return nil, fmt.Errorf("%w: AtLeast for more than %d users in one read", ErrInvalidReadOption, MaxAtLeast)
		default:
			need = append(need, r)
		}
	}
	return need, nil
}

// waitForVersions polls the projection's versions of need's users until
// each has reached its version or Config.ReadYourWritesTimeout passes, and
// returns the index in need of the first requirement unmet at the last
// poll, -1 when all were met (0 with an error). Every poll reads all of
// them, and the layout key, in one round trip: the keys share the board's
// hash tag. The layout matters because with another bucket count stored,
// a user's version is in a key this board does not look at, and with the
// layout key lost the gate writes no version at all, so the wait could
// never succeed; it fails at once with *LayoutMismatchError.
func (b *Board) waitForVersions(ctx context.Context, need []requirement) (int, error) {
	deadline := time.Now().Add(b.cfg.ReadYourWritesTimeout)
	backoff := 2 * time.Millisecond
	keys := make([]string, len(need))
	for i, r := range need {
		keys[i] = b.ks.VersionKey(b.target(r.user))
	}
	cmds := make([]*redis.StringCmd, len(need))
	got := make([]any, len(need))
	unmet := 0 // the first requirement unmet at the last poll answered (none: the first)
	for {
		var layout *redis.SliceCmd
		var unbucketed, values *redis.IntCmd
		// A poll is part of the wait: bounded by its deadline, so that a
		// slow Redis (or a busy client pool) does not stretch the wait
		// past ReadYourWritesTimeout. A timeout spent before the first
		// poll (a few nanoseconds) still gets that one look.
		pctx, cancel := ctx, context.CancelFunc(func() {})
		if time.Now().Before(deadline) {
			pctx, cancel = context.WithDeadline(ctx, deadline)
		}
		err := b.onMaster(pctx, keys[0], func(p redis.Pipeliner) {
			// MGET, as reconcile reads it: a key of another type is no
			// layout (nil), not a WRONGTYPE failure of the read.
			layout = p.MGet(ctx, b.layoutKey)
			unbucketed = p.Exists(ctx, b.unbucketedKey)
			values = p.Exists(ctx, b.zsetKey)
			for i, r := range need {
				cmds[i] = p.HGet(ctx, keys[i], r.user)
			}
		})
		// Only a poll left without an answer is cut: one Redis answered
		// (redis.Nil for an absent version, an error reply) is read as
		// such, even when the answer came after the deadline. A redirect
		// followed until the deadline (clusterpin wraps the MOVED reply
		// in the deadline's error) was left without one. callerEnded
		// tells a poll cut by pctx's deadline apart from one cut by ctx's,
		// also when the connection's i/o timeout came before the timer.
		var replied redis.Error
		cut := err != nil && (!errors.As(err, &replied) || errors.Is(err, context.DeadlineExceeded)) &&
			callerEnded(ctx, err) == nil && callerEnded(pctx, err) != nil
		cancel()
		if cut {
			return unmet, nil // the wait ran out during the poll
		}
		if err != nil && !errors.Is(err, redis.Nil) {
			return 0, fmt.Errorf("leaderboard: reading the projected version: %w", err)
		}
		var stored any
		if v := layout.Val(); len(v) == 1 {
			stored = v[0]
		}
		found := layoutKeysEmpty
		switch {
		case unbucketed.Val() == 1:
			found = layoutKeysUnbucketed
		case values.Val() == 1:
			found = layoutKeysLost
		}
		if lerr := b.checkLayout(stored, found); lerr != nil {
			return 0, lerr
		}
		for i, cmd := range cmds {
			v, err := cmd.Result()
			switch {
			case errors.Is(err, redis.Nil):
				got[i] = nil
			case err != nil:
				return 0, fmt.Errorf("leaderboard: reading the projected version: %w", err)
			default:
				got[i] = v
			}
		}
		first := firstUnmet(need, got)
		if first < 0 {
			return -1, nil
		}
		unmet = first
		wait := min(backoff, time.Until(deadline))
		if wait <= 0 {
			return first, nil
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return 0, ctx.Err()
		case <-t.C:
		}
		backoff = min(2*backoff, 50*time.Millisecond)
	}
}

// firstUnmet returns the index in need of the first requirement whose
// stored version got[i] (the version hash's field, nil when absent) is
// below it, -1 when none is.
func firstUnmet(need []requirement, got []any) int {
	for i, r := range need {
		if text, ok := got[i].(string); ok {
			if v, err := strconv.ParseInt(text, 10, 64); err == nil && v >= r.version {
				continue
			}
		}
		return i
	}
	return -1
}

// layoutKeys is what a projection's keys tell of its bucket count when
// its layout key is absent, read as the gate reads them.
type layoutKeys int64

const (
	// layoutKeysEmpty: nothing projected yet, which any layout fits.
	layoutKeysEmpty layoutKeys = iota
	// layoutKeysUnbucketed: the unbucketed version hash exists, a
	// projection of 0 buckets (one projected before layout keys, or one
	// whose layout key alone was lost).
	layoutKeysUnbucketed
	// layoutKeysLost: the sorted set exists without that hash: the
	// layout key was lost (DEL, eviction) and the bucket count is
	// unknown, which the gate refuses for every writer.
	layoutKeysLost
)

// checkLayout compares the layout key's value (as MGET reads it: nil when
// absent or not a string) with the board's bucket count. Without a layout
// key, found says what the keys tell: 0 buckets, the gate's reading of a
// projection with the unbucketed version hash; an unknown count (stored
// -1), refused like the gate refuses it, for a projection that lost its
// layout key: the version the read waits for would never come; or nothing
// projected yet, which passes: the gate records a layout with the first
// write, which the read then waits for.
func (b *Board) checkLayout(layout any, found layoutKeys) error {
	stored, ok := layout.(string)
	if !ok {
		switch found {
		case layoutKeysUnbucketed:
			stored, ok = "0", true
		case layoutKeysLost:
			stored, ok = "missing", true // not a count: Stored -1
		}
	}
	if !ok || stored == b.layout {
		return nil
	}
	return fmt.Errorf("leaderboard: AtLeast cannot look up the projected version of board %q: %w", b.cfg.Name,
		&projection.LayoutMismatchError{Kind: projection.KindSortedSet, Name: b.cfg.Name,
			Stored: projection.ParseLayout(stored), Configured: b.ks.VersionBuckets()})
}

// lagProbe caches the last lag measurement.
type lagProbe struct {
	at      time.Time     // local time the query was sent; zero before the first
	lag     time.Duration // age of the oldest unprojected row then
	pending bool          // whether any row was unprojected
	failed  bool          // whether the measurement failed or found the clock stepped back
	running bool          // whether a measurement is under way
	// source is the database's identity then (see sourceIdentitySQL),
	// read with Config.RequireVerifiedProjection only; "" otherwise.
	source string
	// notMigrated: the measurement failed on a missing table (dbError's
	// ErrNotMigrated), which reads report instead of a lag of -1.
	notMigrated error
	// gauge is the state of the lag gauge's own probe (observedLag), which
	// a new measurement keeps.
	gauge gaugeProbe
}

// gaugeProbe is the state of the probe the lag gauge runs (observedLag).
type gaugeProbe struct {
	started time.Time // when the probe under way started; zero when none
	// slow: the last probe took longer than lagGaugeWait, or its deadline
	// (lagGaugeTimeout) cut it off.
	slow bool
	// prefetched is when the gauge's prefetch last ran; zero before.
	prefetched time.Time
}

// verification caches the last look for Verify's record in Redis
// (Config.RequireVerifiedProjection). It is kept apart from the lag probe
// so that a slow PostgreSQL cannot delay it: how soon reads see a Redis
// that lost the board's keys depends on Redis alone.
type verification struct {
	at       time.Time     // local time the last published look was sent; zero before the first
	verified bool          // whether Redis held the record then
	source   string        // the database identity the record names; "" when it names none
	look     *verifiedLook // the latest look under way; nil when none
	// epoch counts the records Verify made: a look sent before the latest
	// one may have missed it, and is not published.
	epoch uint64
}

// readLogs limits the warnings a failure could otherwise repeat on every
// read (a Redis read that fails) or every probe (the lag probe, a database
// clock the probe finds stepped back, and the look for Verify's record,
// about once per LagProbeInterval each): see Config.Logger.
type readLogs struct {
	fallback, lagProbe, clockStep, verification, sourceChanged, identity lograte.Limiter
}

// warn logs msg about the board at WARN with err, unless l suppresses it,
// and with the number of occurrences l suppressed since its last line.
func (b *Board) warn(ctx context.Context, l *lograte.Limiter, msg string, err error) {
	if log, suppressed := l.Allow(); log {
		b.cfg.Logger.WarnContext(ctx, msg, "board", b.cfg.Name, "error", err, lograte.Suppressed, suppressed)
	}
}

// verifiedLook is one look for Verify's record.
type verifiedLook struct {
	sent  time.Time
	epoch uint64
	done  chan struct{} // closed once verified and gaveUp are set
	// verified: Redis held the record; source: the database identity it
	// names.
	verified bool
	source   string
	// gaveUp: the looking read's ctx ended first, so nothing was learned.
	gaveUp bool
}

// freshness returns the projection's freshness, measuring the lag at most
// once per Config.LagProbeInterval. While one read measures, concurrent
// reads use the previous measurement instead of queueing behind it (only
// the very first reads of a Board, having none, wait for the first one).
//
// A measurement is trusted as is for LagProbeInterval only: when the probe
// under way takes longer (a saturated pool, a slow database), the reused
// measurement's lag keeps growing with its age, because the projection may
// have fallen behind at any moment since. A measurement's age counts from
// when its query was sent, not from when the reply arrived (a change that
// commits while the reply travels is invisible to it). Reported lag
// therefore understates the true lag by less than LagProbeInterval, however
// long a probe or its reply takes, except for a change whose transaction
// began before the measurement and committed after it: the measurement
// could not see it, and its age counts from its transaction's start, so
// the understatement grows by how long that transaction had been open.
//
// With Config.RequireVerifiedProjection, a measured lag is reported only
// when verifiedLately then finds Verify's record, looked for apart from the
// lag probe and after it, as close to the read's own Redis round trip as
// possible; otherwise Lag is -1 and Unverified is set.
//
// The error is not nil only when the measurement found a table of the
// board missing: an error matching ErrNotMigrated, with Lag -1 as for any
// failed measurement.
func (b *Board) freshness(ctx context.Context) (Freshness, error) {
	b.lagMu.Lock()
	// Before the first measurement there is none to reuse: wait for the
	// one under way instead of each sending another.
	for b.lagProbe.at.IsZero() && b.lagProbe.running {
		first := b.lagFirst
		b.lagMu.Unlock()
		select {
		case <-first:
		case <-ctx.Done():
			return Freshness{Source: SourceRedis, Lag: -1}, nil
		}
		b.lagMu.Lock()
	}
	p := b.lagProbe
	due := p.at.IsZero() || elapsed(time.Now(), p.at) >= b.cfg.LagProbeInterval
	measure := due && !p.running
	var first chan struct{}
	if measure {
		b.lagProbe.running = true
		if p.at.IsZero() {
			first = make(chan struct{})
			b.lagFirst = first
		}
	}
	b.lagMu.Unlock()

	if measure {
		// Unless a measurement is stored, release the probe for a later
		// read to measure: this caller gave up, or a tracer or Logger
		// panicked.
		stored := false
		defer func() {
			if !stored {
				b.lagMu.Lock()
				b.lagProbe.running = false
				b.lagMu.Unlock()
				if first != nil {
					close(first) // a waiter measures instead
				}
			}
		}()
		// Bounded (as the lag gauge's probe is): a probe stuck on a dead
		// connection would otherwise hold its reader, and keep every other
		// read from measuring, until the kernel gave up on the socket. One
		// cut off is a failed measurement (Lag -1); one that takes longer
		// than MaxLag could not show the projection fresh anyway.
		pctx, cancel := context.WithTimeout(ctx, max(b.cfg.MaxLag, lagGaugeTimeout))
		reading, sent, err := b.measureLag(pctx)
		replied := time.Now()
		cancel()
		if callerEnded(ctx, err) != nil {
			// This caller gave up, which says nothing about the database:
			// keep the previous measurement for the other readers, and let
			// the next one measure again (the deferred release).
			return Freshness{Source: SourceRedis, Lag: -1}, nil
		}
		// The measurement holds as of the query's snapshot, which PostgreSQL
		// took after the query was sent and before the reply arrived: stamp
		// it with the sending time, never later than the snapshot. Stamped
		// on arrival, a slow reply would hide a change committed while it
		// travelled, for as long as it travelled.
		p = lagProbe{at: sent, failed: err != nil, source: reading.source}
		if err != nil {
			b.warn(ctx, &b.logs.lagProbe, "leaderboard: measuring projection lag failed", err)
			if nm := b.dbError("measuring projection lag", err); errors.Is(nm, ErrNotMigrated) {
				p.notMigrated = nm
			}
		} else if ahead, stepped := reading.clockStepped(); b.stillStepped(reading, sent, replied) || stepped {
			// Clamped to 0, such a row would make the lag 0 on every probe
			// until the clock caught up with it: FailClosed reads would
			// serve a projection behind by up to the step as fresh. Nor
			// does the clock passing it make its age known: it stays
			// understated by the step until the row is projected.
			p.failed = true
			if log, suppressed := b.logs.clockStep.Allow(); stepped && log {
				b.cfg.Logger.WarnContext(ctx, "leaderboard: the database clock appears to have stepped back: a change of the board not yet projected is dated after it, so the projection lag cannot be measured (reads see Lag -1) until the changes dated up to it are projected",
					"board", b.cfg.Name, "ahead", ahead, lograte.Suppressed, suppressed)
			}
		} else if reading.oldest != nil {
			p.pending = true
			p.lag = reading.dbNow.Sub(*reading.oldest)
		}
		b.lagMu.Lock()
		p.gauge = b.lagProbe.gauge
		b.lagProbe = p
		b.lagMu.Unlock()
		stored = true
		if first != nil {
			close(first)
		}
	}
	if p.failed {
		fresh := Freshness{Source: SourceRedis, Lag: -1}
		if b.cfg.RequireVerifiedProjection && p.notMigrated == nil {
			// The look does not need PostgreSQL: a Redis that lost the
			// board's keys is reported while the lag is unknown too.
			// A probe that read the database's identity (the clock stepped
			// back) still compares it with the record's.
			if verified, source, err := b.verifiedLately(ctx); err == nil && (!verified || !sameSource(source, p.source)) {
				fresh.Unverified = true
			}
		}
		return fresh, p.notMigrated
	}
	if b.cfg.RequireVerifiedProjection {
		verified, source, err := b.verifiedLately(ctx)
		if err != nil {
			return Freshness{Source: SourceRedis, Lag: -1}, nil // this caller gave up
		}
		if !verified {
			return Freshness{Source: SourceRedis, Lag: -1, Unverified: true}, nil
		}
		if !sameSource(source, p.source) {
			if log, suppressed := b.logs.sourceChanged.Allow(); log {
				b.cfg.Logger.WarnContext(ctx, "leaderboard: PostgreSQL is not the database Verify checked the projection against (a failover to a standby, or a restore, since): reads are unverified until Board.Verify",
					"board", b.cfg.Name, "verified_against", source, "database", p.source, lograte.Suppressed, suppressed)
			}
			return Freshness{Source: SourceRedis, Lag: -1, Unverified: true}, nil
		}
	}

	now := time.Now()
	age := elapsed(now, p.at)
	switch {
	case p.pending:
		lag := addLag(p.lag, age)
		return Freshness{Source: SourceRedis, Lag: lag, ProjectedThrough: now.Add(-lag)}, nil
	case age >= b.cfg.LagProbeInterval:
		// Nothing was pending at p.at, but a change committed right after
		// may have been waiting ever since. ProjectedThrough carries no
		// monotonic reading: taken before a host suspend, it would make
		// time.Since(ProjectedThrough) leave the suspend out (see elapsed).
		return Freshness{Source: SourceRedis, Lag: age, ProjectedThrough: now.Round(0).Add(-age)}, nil
	}
	// The measurement's time on today's wall clock: p.at's own wall reading
	// is ahead of it by as much as the wall clock stepped back since.
	return Freshness{Source: SourceRedis, ProjectedThrough: now.Round(0).Add(-age)}, nil
}

// verifiedLately reports whether Redis held Verify's record at some moment
// since LagProbeInterval before the call, so that every read made
// LagProbeInterval or more after Redis lost the board's keys sees the loss,
// however slow PostgreSQL is. It reuses the last look while that look is
// younger than LagProbeInterval (counted from when it was sent, as for the
// lag). Otherwise it waits for the look under way if that one was sent
// within the interval (a Redis round trip, about to be made by the read
// anyway), and looks itself if none was. The error is ctx's, when it ended
// first.
func (b *Board) verifiedLately(ctx context.Context) (verified bool, source string, err error) {
	for {
		b.lagMu.Lock()
		now := time.Now()
		v := b.verification
		if !v.at.IsZero() && elapsed(now, v.at) < b.cfg.LagProbeInterval {
			b.lagMu.Unlock()
			return v.verified, v.source, nil
		}
		if l := v.look; l != nil && elapsed(now, l.sent) < b.cfg.LagProbeInterval {
			b.lagMu.Unlock()
			select {
			case <-l.done:
			case <-ctx.Done():
				return false, "", ctx.Err()
			}
			if l.gaveUp {
				continue // that look's reader gave up: look again
			}
			return l.verified, l.source, nil
		}
		l := &verifiedLook{sent: now, epoch: v.epoch, done: make(chan struct{})}
		b.verification.look = l
		b.lagMu.Unlock()
		return b.lookForVerified(ctx, l)
	}
}

// lookForVerified runs look l and publishes its result to later reads,
// unless a look sent after it was published first (looks overlap when
// Redis takes longer than LagProbeInterval to answer) or Verify recorded
// the projection since l was sent.
func (b *Board) lookForVerified(ctx context.Context, l *verifiedLook) (bool, string, error) {
	verified, source, err := b.projectionVerified(ctx)
	ended := callerEnded(ctx, err)
	gaveUp := ended != nil
	b.lagMu.Lock()
	v := &b.verification
	if v.look == l {
		v.look = nil
	}
	if !gaveUp && l.epoch == v.epoch && l.sent.After(v.at) {
		v.at, v.verified, v.source = l.sent, verified, source
	}
	l.verified, l.source, l.gaveUp = verified, source, gaveUp
	b.lagMu.Unlock()
	close(l.done)
	if gaveUp {
		return false, "", ended
	}
	if err != nil {
		b.warn(ctx, &b.logs.verification, "leaderboard: reading the projection's verification record failed", err)
	}
	return verified, source, nil
}

// callerEnded returns the caller's own context error when err (not nil)
// came from ctx ending rather than from the server: ctx.Err(), or
// context.DeadlineExceeded for an i/o timeout at or after ctx's deadline,
// which go-redis reports with ContextTimeoutEnabled before ctx's own timer
// may have fired. Otherwise nil: err says something about the server.
func callerEnded(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if cerr := ctx.Err(); cerr != nil {
		return cerr
	}
	if deadline, ok := ctx.Deadline(); ok && errors.Is(err, os.ErrDeadlineExceeded) && !time.Now().Before(deadline) {
		return context.DeadlineExceeded
	}
	return nil
}

// verificationRecorded makes the next read look for Verify's record again,
// which Verify has just made, instead of reusing (or waiting for) a look
// that may have missed it.
func (b *Board) verificationRecorded() {
	b.lagMu.Lock()
	b.verification = verification{epoch: b.verification.epoch + 1}
	b.lagMu.Unlock()
}

// observedLag returns the lag for the verity.leaderboard.lag gauge, which
// the SDK asks of every board in turn, one after another, in each
// collection.
//
// When no read has measured the lag (or, with
// Config.RequireVerifiedProjection, looked for Verify's record) for
// LagProbeInterval, it starts a measurement in the background (one at a
// time, bounded by lagGaugeTimeout, awaited by Close) and waits for it
// until lagGaugeWait after that measurement started, or until ctx ends. It
// does not wait for a measurement that has been under way for
// lagGaugeWait already, nor, when the board's last one took longer than
// that, for a new one: a database (or Redis) that does not answer then
// costs a collection about lagGaugeWait in all, not lagGaugeWait per
// board.
//
// The gauge's prefetch (lagPrefetch) calls it with an ended ctx
// lagGaugeWait before the collection it expects, which starts the
// measurement then, if one is due, and returns at once. A collection that
// comes within lagGaugeWait of the expected time asks for a measurement
// current as of the prefetch (the one it started, or one that was current
// then), so it finds that measurement done, or under way for lagGaugeWait
// already, and does not wait.
//
// It reports the last measurement, the oldest pending row aged since (or,
// when it found nothing pending and no newer one answered in time, its
// age, as reads do), and nothing when that measurement failed, the last look found the board
// unverified (reads see a lag of -1), or either is older than two
// LagProbeIntervals plus twice lagGaugeWait (the database or Redis did not
// answer in time): the gauge is then absent rather than frozen at a
// healthy-looking value.
func (b *Board) observedLag(ctx context.Context) (time.Duration, bool) {
	verifying := b.cfg.RequireVerifiedProjection
	prefetch := ctx.Err() != nil
	b.lagMu.Lock()
	g := &b.lagProbe.gauge
	now := time.Now()
	asOf := now // the measurement must be current as of asOf
	if prefetch {
		g.prefetched = now
	} else if now.Sub(g.prefetched) < 2*lagGaugeWait {
		asOf = g.prefetched
	}
	p, v := b.lagProbe, b.verification
	if p.at.IsZero() || elapsed(asOf, p.at) >= b.cfg.LagProbeInterval ||
		verifying && (v.at.IsZero() || elapsed(asOf, v.at) >= b.cfg.LagProbeInterval) {
		deadline := g.started.Add(lagGaugeWait) // of the measurement under way
		if b.lagGaugeProbe == nil {
			done := make(chan struct{})
			b.lagGaugeProbe = done
			g.started, deadline = now, now.Add(lagGaugeWait)
			if g.slow {
				// The last measurement did not answer in time: nor may this
				// one, and every board would wait for its own.
				deadline = now
			}
			untrack := b.group.track()
			go func() {
				defer untrack()
				mctx, cancel := context.WithTimeout(context.Background(), lagGaugeTimeout)
				defer cancel()
				b.freshness(mctx)
				b.lagMu.Lock()
				b.lagGaugeProbe = nil
				g := &b.lagProbe.gauge
				g.started, g.slow = time.Time{}, time.Since(now) > lagGaugeWait
				b.lagMu.Unlock()
				close(done)
			}()
		}
		done := b.lagGaugeProbe
		b.lagMu.Unlock()
		if wait := time.Until(deadline); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-done:
			case <-t.C:
			case <-ctx.Done():
			}
			t.Stop()
		}
		b.lagMu.Lock()
		p, v = b.lagProbe, b.verification
	}
	b.lagMu.Unlock()
	// A measurement the prefetch took is up to twice lagGaugeWait old when
	// the collection comes (see above).
	// Saturated: twice a LagProbeInterval above half the largest Duration
	// would wrap negative and hide every measurement.
	tooOld := time.Duration(math.MaxInt64)
	if b.cfg.LagProbeInterval <= (math.MaxInt64-2*lagGaugeWait)/2 {
		tooOld = 2*b.cfg.LagProbeInterval + 2*lagGaugeWait
	}
	age := elapsed(time.Now(), p.at)
	if p.at.IsZero() || p.failed || age > tooOld {
		return 0, false
	}
	if verifying && (v.at.IsZero() || !v.verified || !sameSource(v.source, p.source) || elapsed(time.Now(), v.at) > tooOld) {
		return 0, false
	}
	if p.pending {
		return addLag(p.lag, age), true
	}
	if elapsed(asOf, p.at) >= b.cfg.LagProbeInterval {
		// No measurement current as of asOf answered in time: nothing was
		// pending at p.at, but a change may have been waiting since, as
		// reads report (see freshness).
		return age, true
	}
	return 0, true
}

// lagGaugeTimeout bounds a lag measurement the lag gauge starts;
// lagGaugeWait bounds how long a collection waits for it, from its start,
// and is how long before the expected collection the prefetch starts it.
const (
	lagGaugeTimeout = 5 * time.Second
	lagGaugeWait    = 250 * time.Millisecond
)

// lagReading is what the lag query read (see lagSQL).
type lagReading struct {
	dbNow time.Time // the database clock
	// oldest is the oldest unprojected row's creation time; nil when none
	// is pending.
	oldest *time.Time
	// ahead is the creation time of an unprojected row (pending, or a dead
	// letter that counts) dated after dbNow; nil when none is.
	ahead *time.Time
	// source is the database's identity (sourceIdentitySQL), read with
	// Config.RequireVerifiedProjection only.
	source string
	// conn is the connection the query ran on: only two readings on one
	// connection are known to read one server's clock (a pool's
	// connections may reach different servers, whose clocks differ).
	conn *pgconn.PgConn
}

// measureLag runs the lag query on a connection of its own and returns
// what it read and the local time the query was sent, taken after the
// connection was acquired so that waiting for the pool is not counted.
func (b *Board) measureLag(ctx context.Context) (r lagReading, sent time.Time, err error) {
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return r, time.Now(), err
	}
	defer conn.Release()
	r.conn = conn.Conn().PgConn()
	sent = time.Now()
	if !b.cfg.RequireVerifiedProjection {
		err = conn.QueryRow(ctx, b.sql.lag, b.stream, b.cfg.Name).Scan(&r.dbNow, &r.oldest, &r.ahead)
		return r, sent, err
	}
	// One round trip for both, the lag first: a server that refuses the
	// identity's functions still has its lag measured.
	batch := &pgx.Batch{}
	batch.Queue(b.sql.lag, b.stream, b.cfg.Name)
	batch.Queue(sourceIdentitySQL)
	results := conn.SendBatch(ctx, batch)
	if err = results.QueryRow().Scan(&r.dbNow, &r.oldest, &r.ahead); err != nil {
		_ = results.Close()
		return r, sent, err
	}
	idErr := results.QueryRow().Scan(&r.source)
	err = results.Close()
	if idErr != nil {
		if !identityUnavailable(idErr) {
			return r, sent, idErr
		}
		r.source = ""
		b.identityUnavailable(ctx, idErr)
		return r, sent, nil
	}
	return r, sent, err
}

// stillStepped records the latest unprojected change r found dated after
// the database clock, and reports whether r's oldest unprojected change is
// dated no later than one a measurement found so (the clock may have passed
// it since, but the change is still unprojected, and its age unknown). It
// forgets the change once r finds none that old.
//
// It also compares the database clock with the local monotonic clock
// since the last reading: when the database clock advanced less than the
// least local time between the two readings, it stepped back, and every
// change written before the step (dated up to what the old clock would
// read now, at most the last reading plus the local time since that
// query was sent) is treated the same way, although none is dated after
// the clock.
func (b *Board) stillStepped(r lagReading, sent, replied time.Time) bool {
	b.lagMu.Lock()
	defer b.lagMu.Unlock()
	if r.ahead != nil && r.ahead.After(b.steppedThrough) {
		b.steppedThrough = *r.ahead
	}
	if last := b.lastClock; !last.sent.IsZero() && last.conn == r.conn {
		least := sent.Sub(last.replied) // local time between the two clock readings, at least
		if least > 0 && r.dbNow.Sub(last.dbNow) < least-clockTolerance(least) {
			if through := last.dbNow.Add(replied.Sub(last.sent)); through.After(b.steppedThrough) {
				b.steppedThrough = through
			}
		}
	}
	b.lastClock.dbNow, b.lastClock.sent, b.lastClock.replied, b.lastClock.conn = r.dbNow, sent, replied, r.conn
	if b.steppedThrough.IsZero() {
		return false
	}
	if r.oldest == nil || r.oldest.After(b.steppedThrough) {
		b.steppedThrough = time.Time{}
		return false
	}
	return true
}

// clockTolerance is how much less than d the database clock may advance
// over a local interval d without counting as a step back: 1 ms plus an
// eighth (chrony slews a clock by up to 8.3 %, ntpd by 0.05 %), which
// understates a lag by that share of a probe interval at most.
func clockTolerance(d time.Duration) time.Duration {
	return time.Millisecond + d/8
}

// clockStepped reports whether r found an unprojected row dated after the
// database clock, whose age, and that of the rows before it, cannot then
// be measured (see lagSQL), and by how much that row is ahead. The lag
// query looks at every row that oldest may be (pending, or a dead letter
// that counts), so oldest is after dbNow only when ahead is set.
func (r lagReading) clockStepped() (time.Duration, bool) {
	if r.ahead == nil {
		return 0, false
	}
	return r.ahead.Sub(r.dbNow), true
}

// elapsed returns how long before now (both local time.Now readings) t
// was: by the monotonic clock, or by the wall clock when that says longer.
// Go's monotonic clock (CLOCK_MONOTONIC on Linux) stops while the host is
// suspended, so after a resume it alone would make a measurement taken
// before the suspend look current, and reads would report its lag,
// understating the true one by the whole suspend. The wall clock counts
// the suspend; stepped forward, it only makes a measurement look older,
// which has it taken again.
func elapsed(now, t time.Time) time.Duration {
	d := now.Sub(t)
	if w := now.Round(0).Sub(t.Round(0)); w > d {
		return w
	}
	return d
}

// addLag returns lag + age (both not negative), or the largest Duration
// when the sum would overflow: a row dated far in the past (created_at of
// year 1 is finite) already measures the largest Duration.
func addLag(lag, age time.Duration) time.Duration {
	if lag > math.MaxInt64-age {
		return math.MaxInt64
	}
	return lag + age
}

// onMaster sends read-only commands on key to the master that owns key
// when the client could send them to a replica, through the board's client
// otherwise. clusterpin.OnMaster sends them after READWRITE (so a master
// demoted by a failover the client's slot map has not caught up with
// answers MOVED instead of serving them as a replica) and follows MOVED
// and ASK replies, staying on masters. Read-only scripts go the same way
// (evalRead).
//
// queue adds the commands to a pipeline; onMaster returns the first failed
// command's error (redis.Nil included), and the caller reads results from
// the commands it queued.
func (b *Board) onMaster(ctx context.Context, key string, queue func(redis.Pipeliner)) error {
	if b.primary != nil {
		return clusterpin.OnMaster(ctx, b.primary, key, queue)
	}
	_, err := b.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		queue(p)
		return nil
	})
	return b.sent(ctx, err)
}

// sent returns err, the error of commands sent through the board's client,
// after asking a Redis Cluster client to reload its slot map when err says
// their node could not be reached (clusterpin.ReloadIfUnreachable): go-redis
// reloads it on redirects and every ClusterStateReloadInterval only, so
// after a master died and a replica took over, the board's commands would
// fail until then, up to a minute. The failed command is not retried; the
// next ones reach the new master. Pinned commands (clusterpin) ask for the
// reload themselves.
func (b *Board) sent(ctx context.Context, err error) error {
	clusterpin.ReloadIfUnreachable(ctx, b.rdb, err)
	return err
}

// redisPage reads up to n entries after c (or from the top) from Redis,
// and the versions of need with them (redisReader).
func (b *Board) redisPage(ctx context.Context, c *cursor, n int, need []requirement) ([]Entry, int, error) {
	if len(need) > 0 {
		script, args := topAtLeastScript, []any{n}
		if c != nil {
			script, args = pageAtLeastScript, []any{strconv.FormatInt(-c.score, 10), c.user, n}
		}
		res, first, err := b.evalWithVersions(ctx, script, need, args...)
		if err != nil {
			return nil, 0, err
		}
		entries, err := parseScriptRange(res)
		return entries, first, err
	}
	if c == nil {
		var cmd *redis.ZSliceCmd
		err := b.onMaster(ctx, b.zsetKey, func(p redis.Pipeliner) { cmd = p.ZRangeWithScores(ctx, b.zsetKey, 0, int64(n-1)) })
		if err != nil {
			return nil, 0, fmt.Errorf("leaderboard: reading Redis: %w", err)
		}
		zs := cmd.Val()
		entries := make([]Entry, len(zs))
		for i, z := range zs {
			user, _ := z.Member.(string)
			score, err := boardScore(user, z.Score)
			if err != nil {
				return nil, 0, err
			}
			entries[i] = Entry{UserID: user, Score: score, Rank: int64(i) + 1}
		}
		return entries, -1, nil
	}
	res, err := b.evalRead(ctx, pageScript, []string{b.zsetKey}, strconv.FormatInt(-c.score, 10), c.user, n)
	if err != nil {
		return nil, 0, fmt.Errorf("leaderboard: reading Redis: %w", err)
	}
	entries, err := parseScriptRange(res)
	return entries, -1, err
}

// redisRank reads user's entry from Redis, score and rank atomically: the
// neighbourhood script with no neighbours. need as in redisReader.
func (b *Board) redisRank(ctx context.Context, user string, need []requirement) (Entry, int, error) {
	entries, first, err := b.redisAround(ctx, user, 0, need)
	if err != nil {
		return Entry{}, first, err
	}
	if len(entries) != 1 || entries[0].UserID != user {
		return Entry{}, 0, fmt.Errorf("leaderboard: unexpected script reply for %q: %v", user, entries)
	}
	return entries[0], first, nil
}

// redisAround reads user's neighbourhood from Redis, and the versions of
// need with it (redisReader).
func (b *Board) redisAround(ctx context.Context, user string, n int, need []requirement) ([]Entry, int, error) {
	if len(need) > 0 {
		res, first, err := b.evalWithVersions(ctx, aroundAtLeastScript, need, user, n)
		if err != nil {
			return nil, 0, err
		}
		if res == nil { // the script's false: no such member
			return nil, first, ErrUserNotFound
		}
		entries, err := parseScriptRange(res)
		return entries, first, err
	}
	res, err := b.evalRead(ctx, aroundScript, []string{b.zsetKey}, user, n)
	if errors.Is(err, redis.Nil) {
		return nil, -1, ErrUserNotFound
	}
	if err != nil {
		return nil, 0, fmt.Errorf("leaderboard: reading Redis: %w", err)
	}
	entries, err := parseScriptRange(res)
	return entries, -1, err
}

// evalWithVersions runs script, a read script under versions.lua
// (withVersions), with the read's own args, and returns the read script's
// result and the index in need of the first requirement whose version
// Redis had not reached when the script ran, -1 when it had reached them
// all. A layout that is not the board's (the wait found it was) fails the
// read with *LayoutMismatchError, as the wait does.
func (b *Board) evalWithVersions(ctx context.Context, script *redis.Script, need []requirement, args ...any) (res any, first int, err error) {
	keys := make([]string, 0, len(need)+3)
	keys = append(keys, b.zsetKey, b.layoutKey)
	argv := make([]any, 0, 1+len(need)+len(args))
	argv = append(argv, len(need))
	for _, r := range need {
		keys = append(keys, b.ks.VersionKey(b.target(r.user)))
		argv = append(argv, r.user)
	}
	keys = append(keys, b.unbucketedKey)
	reply, err := b.evalRead(ctx, script, keys, append(argv, args...)...)
	if err != nil {
		return nil, 0, fmt.Errorf("leaderboard: reading Redis: %w", err)
	}
	parts, ok := reply.([]any)
	var found int64
	var versions []any
	if ok && len(parts) == 4 {
		found, _ = parts[1].(int64)
		versions, _ = parts[2].([]any)
	}
	if len(versions) != len(need) {
		return nil, 0, fmt.Errorf("leaderboard: unexpected script reply %v", reply)
	}
	if err := b.checkLayout(parts[0], layoutKeys(found)); err != nil {
		return nil, 0, err
	}
	return parts[3], firstUnmet(need, versions), nil
}

// evalRead runs a read-only script on keys (all in the board's slot), on
// the master like onMaster when the client could read from a replica: a
// script is sent to the master the slot map names, and a master demoted by
// a failover the map has not caught up with would run it as a replica on a
// READONLY connection.
//
// It sends EVALSHA_RO (EVAL_RO after NOSCRIPT), so that a reader whose ACL
// user may only read the board's keys (%R~) can run it: Redis checks
// EVALSHA and EVAL as writes to every key they name. Every script it runs
// (page.lua, around.lua, and those of withVersions) only reads; Redis would
// refuse a write. go-redis deems the RO variants read-only, which matters
// to a client that routes reads to replicas only, and such a client's
// reads are pinned (b.primary).
func (b *Board) evalRead(ctx context.Context, script *redis.Script, keys []string, args ...any) (any, error) {
	if b.primary == nil {
		res, err := script.RunRO(ctx, b.rdb, keys, args...).Result()
		return res, b.sent(ctx, err)
	}
	return clusterpin.EvalRO(ctx, b.primary, script, keys, args...).Result()
}

// parseScriptRange decodes {first index, {member, score, ...}}.
func parseScriptRange(res any) ([]Entry, error) {
	bad := func() ([]Entry, error) { return nil, fmt.Errorf("leaderboard: unexpected script reply %v", res) }
	pair, ok := res.([]any)
	if !ok || len(pair) != 2 {
		return bad()
	}
	first, ok1 := pair[0].(int64)
	flat, ok2 := pair[1].([]any)
	if !ok1 || !ok2 || len(flat)%2 != 0 {
		return bad()
	}
	entries := make([]Entry, 0, len(flat)/2)
	for i := 0; i < len(flat); i += 2 {
		user, ok1 := flat[i].(string)
		text, ok2 := flat[i+1].(string)
		if !ok1 || !ok2 {
			return bad()
		}
		f, err := strconv.ParseFloat(text, 64)
		if err != nil {
			return bad()
		}
		score, err := boardScore(user, f)
		if err != nil {
			return nil, err
		}
		entries = append(entries, Entry{UserID: user, Score: score, Rank: first + int64(i/2) + 1})
	}
	return entries, nil
}

// boardScore returns the board score of user's sorted-set score z: its
// negation, which must be an integer within [MinScore, MaxScore]. Any other
// z (NaN, ±inf, a fraction, out of range) was left by a hand edit or
// another writer, never by the projection: every Redis read refuses it
// with ErrCorruptScore rather than answer a garbage score (Go's conversion
// of ±inf or of an out-of-range float to int64 is implementation-defined)
// or build a cursor decodeCursor would refuse.
func boardScore(user string, z float64) (int64, error) {
	// ±2^53 are exact doubles, and so is the negation of any double.
	s := -z
	if math.IsNaN(s) || s != math.Trunc(s) || s < float64(MinScore) || s > float64(MaxScore) {
		return 0, fmt.Errorf("%w: member %q of the sorted set has score %v, not the negation of an integer within [%d, %d]",
			ErrCorruptScore, user, z, MinScore, MaxScore)
	}
	return int64(s), nil
}

// pgRead runs read on a connection of its own and returns the local time
// just before read sent its statement, taken after the connection was
// acquired, as measureLag does. PostgreSQL takes the statement's snapshot
// after that time, so every change committed before it is in the answer,
// however long the reply takes to arrive; a time taken on arrival could
// postdate a change committed while the reply travelled, which the answer
// lacks.
func (b *Board) pgRead(ctx context.Context, read func(context.Context, querier) error) (sent time.Time, err error) {
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return sent, b.dbError("reading PostgreSQL", err)
	}
	defer conn.Release()
	sent = time.Now()
	return sent, read(ctx, conn)
}

// querier is what the PostgreSQL reads need: a pool, a connection or a
// transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// pgPage reads up to n entries after c (or from the top) from PostgreSQL,
// ranks included, in one statement (one snapshot), and whether that
// snapshot holds every version of need (pgEntries).
func (b *Board) pgPage(ctx context.Context, db querier, c *cursor, n int, need []requirement) ([]Entry, bool, error) {
	switch {
	case c == nil:
		return b.pgEntries(ctx, db, b.sql.top, need, b.cfg.Name, n)
	case !utf8.ValidString(c.user) || strings.IndexByte(c.user, 0) >= 0:
		// PostgreSQL refuses such text; compare bytes (see cursor).
		return b.pgEntries(ctx, db, b.sql.pageBytes, need, b.cfg.Name, n, c.score, []byte(c.user))
	default:
		return b.pgEntries(ctx, db, b.sql.page, need, b.cfg.Name, n, c.score, c.user)
	}
}

// pgRank reads user's entry from PostgreSQL, and whether the statement's
// snapshot holds every version of need (pgEntries).
func (b *Board) pgRank(ctx context.Context, db querier, user string, need []requirement) (Entry, bool, error) {
	e, met := Entry{UserID: user}, true
	var err error
	if len(need) == 0 {
		err = db.QueryRow(ctx, b.sql.rank, b.cfg.Name, user).Scan(&e.Score, &e.Rank)
	} else {
		var score, rank *int64 // NULL: no entry
		users, versions := requirementArrays(need)
		err = db.QueryRow(ctx, b.sql.atLeast[b.sql.rank], b.cfg.Name, user, users, versions).Scan(&score, &rank, &met)
		if err == nil && score == nil {
			err = pgx.ErrNoRows
		} else if err == nil {
			e.Score, e.Rank = *score, *rank
		}
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return Entry{}, met, ErrUserNotFound
	}
	if err != nil {
		return Entry{}, false, b.dbError("reading PostgreSQL", err)
	}
	return e, met, nil
}

// pgAround reads user's neighbourhood from PostgreSQL in one statement,
// and whether its snapshot holds every version of need (pgEntries).
func (b *Board) pgAround(ctx context.Context, db querier, user string, n int, need []requirement) ([]Entry, bool, error) {
	entries, met, err := b.pgEntries(ctx, db, b.sql.around, need, b.cfg.Name, user, n)
	if err != nil {
		return nil, false, err
	}
	if len(entries) == 0 {
		return nil, met, ErrUserNotFound
	}
	return entries, met, nil
}

// pgEntries runs read statement q (columns user id, score, rank) with
// args. With requirements it runs q's variant (withAtLeast) instead, which
// also reports whether PostgreSQL held every version of need in the
// snapshot the entries were read from; met is true without requirements.
func (b *Board) pgEntries(ctx context.Context, db querier, q string, need []requirement, args ...any) (entries []Entry, met bool, err error) {
	entries, met = []Entry{}, true // as pgx.CollectRows: empty, not nil
	var rows pgx.Rows
	if len(need) == 0 {
		rows, err = db.Query(ctx, q, args...)
	} else {
		users, versions := requirementArrays(need)
		rows, err = db.Query(ctx, b.sql.atLeast[q], append(args, users, versions)...)
	}
	if err != nil {
		return nil, false, b.dbError("reading PostgreSQL", err)
	}
	defer rows.Close()
	for rows.Next() {
		var e Entry
		if len(need) == 0 {
			err = rows.Scan(&e.UserID, &e.Score, &e.Rank)
		} else {
			var user *string // NULL: the answer is empty
			var score, rank *int64
			if err = rows.Scan(&user, &score, &rank, &met); err == nil && user == nil {
				continue
			}
			if err == nil {
				e.UserID, e.Score, e.Rank = *user, *score, *rank
			}
		}
		if err != nil {
			return nil, false, b.dbError("reading PostgreSQL", err)
		}
		entries = append(entries, e)
	}
	if err := rows.Err(); err != nil {
		return nil, false, b.dbError("reading PostgreSQL", err)
	}
	return entries, met, nil
}

// requirementArrays returns need's users and versions as the parallel
// arrays of atLeastSQL.
func requirementArrays(need []requirement) ([]string, []int64) {
	users, versions := make([]string, len(need)), make([]int64, len(need))
	for i, r := range need {
		users[i], versions[i] = r.user, r.version
	}
	return users, versions
}
