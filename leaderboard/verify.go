package leaderboard

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/clusterpin"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

var (
	//go:embed verified.lua
	verifiedLua    string
	verifiedScript = redis.NewScript(verifiedLua)

	//go:embed verify_begin.lua
	verifyBeginLua    string
	verifyBeginScript = redis.NewScript(verifyBeginLua)

	//go:embed verify_abandon.lua
	verifyAbandonLua    string
	verifyAbandonScript = redis.NewScript(verifyAbandonLua)
)

// heldTokenPrefix starts the token of every pass that records the sorted
// set's size beside its record (heldKey), which readers then require: a
// record without it is an earlier release's, trusted as before (see
// "Upgrading"). No UUID starts with it ('h' is no hex digit).
const heldTokenPrefix = "held-"

// verifyAbandonTimeout bounds the calls a Verify makes after its own ctx
// may have ended: asking again whether its recording happened, after the
// reply was lost, and deleting its pass's marker when it records nothing.
const verifyAbandonTimeout = 5 * time.Second

// Verify runs a full reconcile pass over the board and, when the pass
// repaired every entry it found wrong (a repair that raced a newer write
// counts: the newer entry is there; each entry whose repair the gate
// declined is checked again after the pass, with CheckKeys and cfg's
// hooks, since a foreign write, at the same version with another value or
// at a version PostgreSQL never had, is declined too; one still declined
// after three such rechecks records nothing, and the report adds what the
// rechecks found) and Redis kept the board's keys
// throughout and did not fail over (a replica promoted during the pass may
// lack its repairs: replication is asynchronous), and the sorted set
// and the board's version keys still hold at least as many members and
// versions as the pass checked users (a DEL of either alone, or its
// eviction, during the pass loses members or versions the pass had
// already found current, and a user without a version takes any
// redelivered older score; that also deletes an earlier Verify's record;
// the check counts, and a loss that as many new users' first
// scores made up for meanwhile goes unseen), records in Redis that the
// projection is complete. With
// Config.RequireVerifiedProjection, reads report Lag -1 and Unverified until
// that record exists; a Redis that loses its data loses the record too.
// verified tells whether it was recorded; when it was not, run Verify again
// (the report says what stood in the way). If the reply to the recording
// is lost and asking again fails too, err matches ErrVerifyUncertain
// (errors.Is), wrapping the Redis client's error. A pass that fails returns
// the report so far and the pass's error wrapped (errors.Is and errors.As
// reach it: ErrNotMigrated for a board never migrated, reconcile's errors).
//
// The record names the database the pass read (its system identifier and
// timeline): reads stop trusting it once the lag probe finds PostgreSQL is
// another (a promoted standby, a point-in-time recovery, a logical restore
// into a new cluster; see "When PostgreSQL goes back" for what keeps the
// identity). A pass during which that
// identity changed records nothing (logged at Warn; run Verify again).
//
// A pass that finds an entry wrong and leaves it so (reported, vetoed, not
// attempted or uncertain; also when the pass then fails) deletes the record
// of an earlier Verify, whichever process made it: the projection it
// vouched for is known wrong now. Reads that require a verified projection
// then refuse or fall back until a Verify finds it right. (Two Verify
// calls that overlap may thus leave no record although the later one made
// one; run Verify again.)
//
// cfg configures the pass's Reconciler as for Board.Reconciler. Its Policy
// must repair every class the pass finds: the default repairs missing,
// stale and corrupt entries but only reports ahead and orphan ones (Redis
// holding a version or a member PostgreSQL does not have: a restored
// database, a hand edit), so a board with any of those is never recorded
// as verified. Investigate them, then repair them with
// reconcile.Policy{Ahead: reconcile.ActionRepair, Orphan:
// reconcile.ActionRepair} or rebuild the projection. cfg.SkipOrphans is
// refused with a *ConfigError: a pass that does not look for orphans cannot
// vouch that Redis holds no user PostgreSQL lacks.
//
// While the pass runs, Redis holds its marker (the key SortedSetKey() +
// "~verifying"); a Verify that records nothing, an error included,
// deletes it before returning. A process that dies during a pass, or a
// Redis that fails that deletion, leaves it until the board's next Verify,
// which replaces it; it never stands for a verified projection.
func (b *Board) Verify(ctx context.Context, cfg *reconcile.Config) (report *reconcile.Report, verified bool, err error) {
	if cfg != nil && cfg.SkipOrphans {
		// Wrapping reconcile's error, as for the reconcile.Config fields
		// reconcile checks itself (ConfigError.Err).
		const reason = "is set; Verify records that Redis holds nothing PostgreSQL lacks, which only the orphan check can tell: leave it false for Verify"
		return nil, false, &ConfigError{Field: "reconcile.Config.SkipOrphans", Reason: reason,
			Err: &reconcile.ConfigError{Field: "Config.SkipOrphans", Reason: reason}}
	}
	// A repair the gate declined is raced: a newer write, which the entry
	// now holds, or a foreign one (the same version with another value, or
	// a version PostgreSQL never had: a hand edit, a buggy writer), which
	// leaves a value PostgreSQL never had. The pass's raced keys are
	// checked again before recording.
	var (
		racedMu sync.Mutex
		raced   []string
	)
	withRaced := reconcile.Config{}
	if cfg != nil {
		withRaced = *cfg
	}
	observe := withRaced.AfterRepair
	withRaced.AfterRepair = func(ctx context.Context, f reconcile.Finding) {
		if f.Result == reconcile.ResultRaced {
			racedMu.Lock()
			raced = append(raced, f.Key)
			racedMu.Unlock()
		}
		if observe != nil {
			observe(ctx, f)
		}
	}
	rec, err := b.Reconciler(&withRaced)
	if err != nil {
		return nil, false, err
	}
	// The record names the database the pass compared Redis with: reads
	// stop trusting it once PostgreSQL is another one (a promoted standby,
	// a restore), which may lack commits the projection still shows.
	source, err := b.sourceIdentity(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("leaderboard: verify: reading the database's identity: %w", err)
	}
	token := heldTokenPrefix + uuid.NewString()
	if err := b.sent(ctx, verifyBeginScript.Run(ctx, b.rdb, []string{b.verifyingKey}, token).Err()); err != nil {
		if !isRedisReply(err) {
			// The reply may be all that was lost: the marker is ours then.
			b.abandonVerify(ctx, token, false)
		}
		return nil, false, fmt.Errorf("leaderboard: verify: %w", err)
	}
	refuted := false
	defer func() {
		if !verified {
			b.abandonVerify(ctx, token, refuted)
		}
	}()
	report, err = rec.Run(ctx, reconcile.RunOptions{})
	// Only a projection left equal to PostgreSQL is recorded: every
	// finding repaired, or raced by a newer write. One reported (the
	// policy's choice), vetoed, not attempted or uncertain stands in the
	// way, and refutes an earlier record too: this pass saw Redis wrong.
	refuted = leftWrong(report)
	racedMu.Lock()
	recheck := raced
	raced = nil
	racedMu.Unlock()
	// A recheck raced again is checked again, a few times: a foreign
	// writer that keeps writing would otherwise be recorded verified.
	racedAgain := false
	for round := 0; err == nil && !refuted && len(recheck) > 0; round++ {
		if round == 3 {
			racedAgain = true // record nothing, refute nothing
			break
		}
		var again *reconcile.Report
		again, err = rec.CheckKeys(ctx, recheck, reconcile.RunOptions{})
		refuted = leftWrong(again)
		addRecheck(report, again, withRaced.ExamplesPerClass)
		racedMu.Lock()
		recheck, raced = raced, nil
		racedMu.Unlock()
	}
	if err != nil {
		return report, false, fmt.Errorf("leaderboard: verify: %w", err)
	}
	if racedAgain {
		b.cfg.Logger.WarnContext(ctx, "leaderboard: verify: an entry's repair was declined again in three rechecks (a writer keeps changing it); nothing recorded, run Verify again",
			"board", b.cfg.Name)
	}
	if refuted || racedAgain {
		return report, false, nil
	}
	after, err := b.sourceIdentity(ctx)
	if err != nil {
		return report, false, fmt.Errorf("leaderboard: verify: reading the database's identity: %w", err)
	}
	if !sameSource(source, after) {
		// Part of the pass may have read the database before a failover.
		b.cfg.Logger.WarnContext(ctx, "leaderboard: verify: PostgreSQL changed during the pass (a failover?); nothing recorded, run Verify again",
			"board", b.cfg.Name, "before", source, "after", after)
		return report, false, nil
	}
	if err := ctx.Err(); err != nil {
		// Not sent: the retry below is for a reply lost, not for a call
		// the caller's cancellation kept from being made.
		return report, false, fmt.Errorf("leaderboard: verify: %w", err)
	}
	// Every source row the pass checked is in the sorted set after it,
	// with its version (current, repaired, or overtaken by a newer
	// write): fewer members or versions mean some were lost during the
	// pass, after it had found them.
	args := []any{token, time.Now().UTC().Format(time.RFC3339Nano) + " " + source + " " + b.outboxTag, report.Checked}
	keys := append([]string{b.verifyingKey, b.verifiedKey, b.zsetKey, b.heldKey}, b.ks.VersionKeys(b.cfg.Name, projection.KindSortedSet)...)
	n, err := verifiedScript.Run(ctx, b.rdb, keys, args...).Int()
	err = b.sent(ctx, err)
	if err != nil && !isRedisReply(err) {
		// The reply was lost, not the recording perhaps. The script tells
		// when run again: it records if the first run never happened, and
		// finds this pass's record if it did.
		retryCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), verifyAbandonTimeout)
		n, err = verifiedScript.Run(retryCtx, b.rdb, keys, args...).Int()
		cancel()
		if err != nil && !isRedisReply(err) {
			return report, false, fmt.Errorf("%w: %w", ErrVerifyUncertain, err)
		}
	}
	if err != nil {
		return report, false, fmt.Errorf("leaderboard: verify: recording the result: %w", err)
	}
	switch n {
	case 1:
		b.verificationRecorded()
	case 2:
		// This pass saw members that are gone: an earlier record,
		// which vouches for fewer members, must not stand either.
		refuted = true
		b.cfg.Logger.WarnContext(ctx, "leaderboard: verify: the sorted set or its version keys lost members during the pass (a DEL of one, its eviction); nothing recorded, run Verify again",
			"board", b.cfg.Name)
	case 3:
		b.cfg.Logger.WarnContext(ctx, "leaderboard: verify: another Verify of the board began during this pass and replaced its marker; nothing recorded by this pass (the other records if it completes)",
			"board", b.cfg.Name)
	default:
		b.cfg.Logger.WarnContext(ctx, "leaderboard: verify: the pass's marker is gone (another Verify of the board began and ended during this pass, Redis lost the key, or a failover), so its repairs may be lost; nothing recorded, run Verify again",
			"board", b.cfg.Name)
	}
	return report, n == 1, nil
}

// addRecheck adds to report, Verify's pass's, what a recheck of its raced
// entries found (not the entries found current again: the pass checked
// those), so that the report says what stood in the way: counts, results
// and repairs by class, and examples up to examplesPerClass (0: the
// default) per class.
func addRecheck(report, again *reconcile.Report, examplesPerClass int) {
	if report == nil || again == nil {
		return
	}
	if examplesPerClass == 0 {
		examplesPerClass = reconcile.ExamplesPerClassDefault
	}
	for c, n := range again.Counts {
		if c != reconcile.ClassCurrent {
			report.Counts = addCount(report.Counts, c, n)
		}
	}
	for res, n := range again.Results {
		report.Results = addCount(report.Results, res, n)
	}
	for c, n := range again.RepairedByClass {
		report.RepairedByClass = addCount(report.RepairedByClass, c, n)
	}
	for c, found := range again.Examples {
		if report.Examples == nil {
			report.Examples = map[reconcile.Class][]reconcile.Finding{}
		}
		room := max(0, examplesPerClass-len(report.Examples[c]))
		report.Examples[c] = append(report.Examples[c], found[:min(room, len(found))]...)
	}
	report.Repaired += again.Repaired
	report.Skipped += again.Skipped
	report.Uncertain += again.Uncertain
}

// addCount adds n to m[k], making m if it is nil.
func addCount[K comparable](m map[K]int64, k K, n int64) map[K]int64 {
	if m == nil {
		m = map[K]int64{}
	}
	m[k] += n
	return m
}

// leftWrong reports whether a pass found an entry wrong and left it so.
func leftWrong(report *reconcile.Report) bool {
	if report == nil {
		return false
	}
	for result, n := range report.Results {
		if n > 0 && result != reconcile.ResultRepaired && result != reconcile.ResultRaced {
			return true
		}
	}
	return false
}

// abandonVerify deletes the marker of the pass token if it is still there,
// also after ctx has ended, and, when refuted, the record of an earlier
// Verify: the pass found the projection wrong and left it so (entries it
// only reported, for one), so reads that require a verified projection
// must stop trusting it. A failure to delete the marker only leaves it to
// the next Verify; a failure to delete the record leaves an earlier
// verification standing that this pass contradicted: both are logged, not
// returned (the pass's own result is what Verify returns).
func (b *Board) abandonVerify(ctx context.Context, token string, refuted bool) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), verifyAbandonTimeout)
	defer cancel()
	refute := "0"
	if refuted {
		refute = "1"
	}
	err := b.sent(ctx, verifyAbandonScript.Run(ctx, b.rdb, []string{b.verifyingKey, b.verifiedKey, b.heldKey}, token, refute).Err())
	switch {
	case err != nil && refuted:
		b.cfg.Logger.Error("leaderboard: verify: the pass found the projection wrong, but deleting the earlier verification record failed: reads may still trust it; run Verify again",
			"board", b.cfg.Name, "error", err)
	case err != nil:
		b.cfg.Logger.Warn("leaderboard: verify: deleting the pass's marker failed", "board", b.cfg.Name, "error", err)
	}
	if refuted {
		b.verificationRecorded() // this process's reads look again
	}
}

// isRedisReply reports an error that Redis sent: the command ran, and
// failed.
func isRedisReply(err error) bool {
	var reply redis.Error
	return errors.As(err, &reply)
}

// outboxTagPrefix begins the field of Verify's record that names the
// board's outbox table (hex of its qualified name).
const outboxTagPrefix = "o="

// projectionVerified reports whether Redis holds Verify's record that the
// projection is complete, read on the master, and the database identity
// the record names ("" for a record of a release that named none). A
// record no longer counts once the sorted set holds fewer members than the
// pass found (a DEL of it alone, its eviction, also after new scores
// recreated it): the board would read without them. A Board that saw it
// so never counts that record again (b.shortRecord), even once new scores
// make the sorted set as large; one that did not look meanwhile (started
// since, or the set grew back within a LagProbeInterval) does. Members
// gained since the pass are not counted: a loss of those alone goes unseen
// (on a board verified empty, any loss) until the next pass. Nor does it count
// without its companion, the size the pass found (heldKey), which an
// eviction can take with the sorted set; a record of an earlier release
// (its token lacks heldTokenPrefix) without one (or beside another pass's,
// which is not its own) does while the sorted set holds members.
func (b *Board) projectionVerified(ctx context.Context) (verified bool, source string, err error) {
	var record, held *redis.StringCmd
	var exists *redis.IntCmd
	err = b.onMaster(ctx, b.verifiedKey, func(p redis.Pipeliner) {
		record, held, exists = p.Get(ctx, b.verifiedKey), p.Get(ctx, b.heldKey), p.ZCount(ctx, b.zsetKey, "-inf", "+inf")
	})
	migrating := false
	for _, cmd := range []redis.Cmder{record, held, exists} {
		if cmd != nil && (clusterpin.IsRedirect(cmd.Err()) || redis.IsTryAgainError(cmd.Err())) {
			migrating = true
		}
	}
	if b.primary != nil && migrating {
		// The slot is being migrated: a pinned pipeline follows an ASK
		// with its first command only. One command at a time, each
		// follows its own.
		err = nil
		for _, q := range []func(redis.Pipeliner){
			func(p redis.Pipeliner) { record = p.Get(ctx, b.verifiedKey) },
			func(p redis.Pipeliner) { held = p.Get(ctx, b.heldKey) },
			func(p redis.Pipeliner) { exists = p.ZCount(ctx, b.zsetKey, "-inf", "+inf") },
		} {
			if e := b.onMaster(ctx, b.verifiedKey, q); e != nil && !errors.Is(e, redis.Nil) {
				err = e
				break
			}
		}
	}
	if err != nil && !errors.Is(err, redis.Nil) {
		return false, "", err
	}
	for _, cmd := range []redis.Cmder{record, held, exists} {
		if err := cmd.Err(); err != nil && !errors.Is(err, redis.Nil) {
			return false, "", err
		}
	}
	if record.Err() != nil {
		return false, "", nil // no record
	}
	// "<token> <time> <source> <outbox tag>"; see Verify. The source is
	// empty where the identity cannot be read, and earlier releases wrote
	// no outbox tag.
	fields := strings.Fields(record.Val())
	if len(fields) >= 3 && !strings.HasPrefix(fields[2], outboxTagPrefix) {
		source = fields[2]
	}
	for _, f := range fields[min(len(fields), 2):] {
		if strings.HasPrefix(f, outboxTagPrefix) && f != b.outboxTag {
			// Made while the board used another outbox table: rows left
			// pending there are neither projected by this board's Worker
			// nor counted in its Lag.
			return false, "", nil
		}
	}
	companion := held.Err() == nil
	if companion && len(fields) > 0 && !strings.HasPrefix(fields[0], heldTokenPrefix) {
		// Another pass's companion is none of an earlier release's record.
		// Beside this release's record it is the companion of a pass that
		// recorded between the pipeline's GETs (Redis need not run them
		// together): its size holds for the newer record, checked below.
		token, _, _ := strings.Cut(held.Val(), " ")
		companion = token == fields[0]
	}
	if !companion {
		if len(fields) > 0 && strings.HasPrefix(fields[0], heldTokenPrefix) {
			return false, "", nil // the companion is lost (evicted), so may members be
		}
		// An earlier release's record: made without a companion, or with
		// one that an eviction took with the sorted set. Trusted as
		// before only while the sorted set holds members.
		return exists.Val() > 0, source, nil
	}
	if len(fields) > 0 {
		_, size, _ := strings.Cut(held.Val(), " ")
		n, perr := strconv.ParseInt(size, 10, 64)
		if perr != nil {
			n = 1 // no size: the token alone
		}
		b.lagMu.Lock()
		defer b.lagMu.Unlock()
		if exists.Val() < n {
			b.shortRecord = fields[0]
			return false, "", nil // members the pass saw are gone
		}
		if b.shortRecord == fields[0] {
			return false, "", nil // they were gone once: new ones need not be them
		}
	}
	return true, source, nil
}

// sourceIdentity reads the database's identity (sourceIdentitySQL), ""
// where the server refuses its functions (identityUnavailable, logged).
func (b *Board) sourceIdentity(ctx context.Context) (string, error) {
	var id string
	err := b.pool.QueryRow(ctx, sourceIdentitySQL).Scan(&id)
	if err != nil && identityUnavailable(err) {
		b.identityUnavailable(ctx, err)
		return "", nil
	}
	return id, err
}

// identityUnavailable reports an error with which the server refused the
// functions sourceIdentitySQL calls (revoked from the role, or not offered
// by a managed service): without the identity, Verify's record names no
// database and reads do not compare it, as before records named one.
func identityUnavailable(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "42501", "0A000", "55000", "42883": // insufficient privilege, not supported, prerequisite state, undefined function
		return true
	}
	return false
}

// identityUnavailable logs, at most once a second, that err kept the
// board from reading the database's identity.
func (b *Board) identityUnavailable(ctx context.Context, err error) {
	b.warn(ctx, &b.logs.identity, "leaderboard: the database's identity cannot be read (pg_control_system, pg_walfile_name, pg_current_wal_lsn, pg_control_checkpoint, pg_control_recovery), so RequireVerifiedProjection cannot see a failover or restore; grant the board's role EXECUTE on them", err)
}

// sameSource reports whether recorded, the database identity Verify's
// record names, and current, the one the lag probe read (both from
// sourceIdentitySQL), may be one database with one history. The system
// identifiers must be equal. A primary's timeline must equal the
// record's, which must have been made on a primary too: a record made on
// a standby cannot tell which timeline it checked. A standby's timeline
// is a lower bound, so it differs only once it passes the record's: a
// standby that follows a promoted one is seen at its next restartpoint at
// the latest. An empty identity (a server that refuses the functions) is
// not compared; a malformed one differs.
func sameSource(recorded, current string) bool {
	if recorded == "" || current == "" {
		return true
	}
	rs, rt, _ := strings.Cut(recorded, ":")
	cs, ct, _ := strings.Cut(current, ":")
	if rs != cs {
		return false
	}
	cBound, onStandby := strings.CutPrefix(ct, "~")
	if !onStandby {
		return rt == ct && !strings.HasPrefix(rt, "~")
	}
	rTimeline, err := strconv.ParseUint(strings.TrimPrefix(rt, "~"), 16, 32)
	if err != nil {
		return false
	}
	cTimeline, err := strconv.ParseUint(cBound, 16, 32)
	return err == nil && cTimeline <= rTimeline
}
