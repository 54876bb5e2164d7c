package reconcile

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/clusterpin"
	"github.com/verity-go/verity/projection"
)

//go:embed rebuild.lua
var rebuildSource string

// RebuildReport summarises a Rebuild.
type RebuildReport struct {
	// Started is when the rebuild began; Duration how long it took.
	Started  time.Time
	Duration time.Duration
	// Rows counts source rows copied into the shadow keys (sent to them:
	// Applied plus Kept). The switch requires Redis's copy count to equal
	// it.
	Rows int64
	// Applied counts rows written into the shadow keys; Kept counts rows
	// whose shadow entry was already as new or newer (a gate write made
	// during the rebuild, dual-written into the shadow, wins).
	Applied int64
	Kept    int64
	// Conflicts counts, among Kept, rows whose shadow entry already held
	// the row's version with another value (projection.OutcomeConflict):
	// a live write dual-written during the rebuild disagreed with the
	// source at the same version (the source reused a version, or the
	// Mapper and the Source encode the entity differently). The shadow
	// keeps the live write's value, so after the switch a Run finds the
	// entity corrupt and, by default, repairs it; the rebuild logs a
	// warning when there are any.
	Conflicts int64
	// Switched reports whether the shadow keys replaced the live keys; it
	// is false too when that is unknown (ErrRebuildUncertain).
	Switched bool
}

// Rebuild rebuilds a collection projection (sorted set or hash) from the
// source and switches readers to it atomically:
//
//  1. One script clears leftover shadow keys and sets the rebuild marker
//     (with Config.RebuildMarkerTTL). From then on the gate applies every
//     live write to the shadow keys too.
//  2. The source is copied page by page into the shadow keys through
//     projection.Gate.ApplyShadowCopy, by the gate's rule: only a newer
//     version is written, so a newer gate write made meanwhile is never
//     overwritten by an older source page. The same script call counts the
//     page's rows in the collection's copy count
//     (projection.Keyspace.RebuildCopyKey). The marker's TTL is extended as
//     pages go.
//  3. One script, if the marker is still this rebuild's, the copy count
//     equals the rows the copy sent, and the shadow holds at least as many
//     members and versions as those rows and as the gate's writes created
//     there, RENAMEs the shadow keys over the live keys and deletes the
//     marker and the count.
//
// The shadow keys are built in the version layout of Target.Keyspace (its
// bucket count), and the switch also sets the collection's layout key to
// that count (0 included) and removes the version keys of the old layout, so a Rebuild with a new
// bucket count is how a live collection migrates to it; writers still on
// the old count dual-write into the new layout during the copy and are
// refused (projection.ErrLayoutMismatch) after the switch. A collection
// that lost its layout key (values without the unbucketed version hash)
// has an unknown bucket count, so the switch then removes the version keys
// of every possible bucket.
//
// Readers keep reading the old projection until the switch and never see
// an empty or half-built one. Every key involved shares the collection's
// hash tag, so this works unchanged on Redis Cluster. The result matches
// the source: ahead entries are replaced by the source's state and orphans
// disappear, which makes Rebuild the remedy when a Run reports many. (A row
// deleted from the source after the copy read it survives the switch as an
// orphan, which the next Run reports: the gate never deletes.)
//
// If ctx is cancelled or anything fails before the switch, the marker and
// shadow keys are removed and the live projection is left as it was; also
// when the reply to the first step is lost, so that its marker does not
// hold other rebuilds off. That clean-up has Config.RepairTimeout: if Redis
// does not answer it either (a server that stopped answering), the error
// says so, the marker holds other rebuilds off (ErrRebuildInProgress)
// until it expires (Config.RebuildMarkerTTL), and the shadow keys stay
// until the next Rebuild of the collection starts; the live projection is
// still left as it was. If the reply to the switch is lost, Rebuild
// returns ErrRebuildUncertain: either projection may be live, whole. A
// step the client resends by itself after Redis ran it (go-redis does,
// up to Options.MaxRetries times, when a connection drops before the
// reply) gets the first run's answer: a start finding its own marker
// succeeds without clearing the shadow again, and the switch leaves its
// token in a short-lived key (P T:z~rebuild~switched, for twice
// Config.RepairTimeout or the marker TTL if longer) that a resent switch
// answers "switched" from. If
// the marker was lost (its TTL expired because the process stalled),
// Rebuild returns ErrRebuildAborted. So it does if Redis lost some of the
// copy's writes but kept the marker (a failover to a replica that had not
// received them, a restart from a snapshot taken during the copy): the
// count, written with the rows, falls short, and switching would replace
// the live projection by a partial one, deleting members that survived.
// If another rebuild holds the marker, it returns ErrRebuildInProgress.
// Documents cannot be rebuilt (ErrRebuildUnsupported): use Run.
func (r *Reconciler) Rebuild(ctx context.Context) (*RebuildReport, error) {
	if r.unmade() {
		return &RebuildReport{Started: time.Now()}, errUnmade()
	}
	rep, err := r.rebuild(ctx)
	rep.Duration = time.Since(rep.Started)
	r.logFinished(ctx, "reconcile rebuild finished", err,
		slog.Int64("rows", rep.Rows), slog.Int64("applied", rep.Applied),
		slog.Int64("kept", rep.Kept), slog.Int64("conflicts", rep.Conflicts), slog.Bool("switched", rep.Switched),
		slog.Duration("duration", rep.Duration))
	r.reloadIfUnreachable(ctx, err)
	r.metrics.recordRebuild(ctx, rep, err)
	return rep, err
}

func (r *Reconciler) rebuild(ctx context.Context) (*RebuildReport, error) {
	rep := &RebuildReport{Started: time.Now()}
	if r.target.Kind == projection.KindDocument {
		return rep, ErrRebuildUnsupported
	}
	if err := r.refuseFrozenSource(ctx, "Rebuild cannot run through it: a write committed and projected after its snapshot but before the rebuild started would be neither copied nor dual-written, and the switch would take it back; give NewSQLSource a pool"); err != nil {
		return rep, err
	}
	var buf [16]byte
	_, _ = rand.Read(buf[:])
	token := hex.EncodeToString(buf[:])
	ttl := strconv.FormatInt(r.cfg.RebuildMarkerTTL.Milliseconds(), 10)
	// The switched key must outlive every resend of the switch, all sent
	// within RepairTimeout of it (and be at least 100ms, as the TTL is).
	// Twice RepairTimeout saturates: a RepairTimeout above half the
	// largest Duration would otherwise wrap negative.
	twice := time.Duration(math.MaxInt64)
	if r.cfg.RepairTimeout <= math.MaxInt64/2 {
		twice = 2 * r.cfg.RepairTimeout
	}
	switchedTTL := strconv.FormatInt(max(r.cfg.RebuildMarkerTTL, twice).Milliseconds(), 10)
	step := func(ctx context.Context, name string) (bool, error) {
		n, err := r.rebuildStep(ctx, name, token, ttl, 0)
		if err != nil {
			return false, wrap("rebuild "+name, err)
		}
		return n == 1, nil
	}

	ok, err := step(ctx, "start")
	if err == nil && !ok {
		return rep, ErrRebuildInProgress
	}
	if err == nil {
		err = r.copyToShadow(ctx, rep, token, step)
		if err == nil {
			// The switch runs even if ctx is cancelled now: the copy is
			// complete, and a switch whose reply is lost would leave the
			// caller unsure which projection is live.
			switchCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.RepairTimeout)
			var n int64
			n, err = r.rebuildStep(switchCtx, "switch", token, switchedTTL, rep.Rows)
			cancel()
			switch {
			case err != nil && (answered(err) || errors.As(err, new(*stepNotSentError))):
				err = wrap("rebuild switch", err)
			case err != nil:
				// The sentinel's text names the switch already.
				err = fmt.Errorf("%w: %w", ErrRebuildUncertain, err)
			case n == 1:
				rep.Switched = true
			case n == switchIncomplete:
				err = fmt.Errorf("%w: Redis no longer holds every row the copy wrote into the shadow keys (%d sent), "+
					"yet kept the marker: it lost writes (a failover, a restart from an older snapshot, an eviction)", ErrRebuildAborted, rep.Rows)
			default:
				err = errMarkerLost // a reply: the marker was gone
			}
		}
	}
	// Also after a failed start, whose reply may be all that was lost: its
	// marker would otherwise hold off other rebuilds for its TTL. Abort
	// removes only this rebuild's marker, and after a switch that did
	// happen it finds nothing of this rebuild's left to remove.
	if err != nil && !rep.Switched {
		abortCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.RepairTimeout)
		// Redis Cluster refuses every step (TRYAGAIN) while the
		// collection's slot is being migrated: try again until it has
		// moved, or the marker would hold other rebuilds off for its TTL.
		// go-redis's redirects run out as often on an ASK (the source
		// master lacks every key the step declares) or a MOVED (the slot
		// has just been assigned) as on TRYAGAIN: those too, for a
		// cluster client (a single-server client on a cluster node is
		// redirected for good).
		_, onCluster := r.target.Client.(*redis.ClusterClient)
		var aerr error
		for {
			_, aerr = step(abortCtx, "abort")
			if !(redis.IsTryAgainError(aerr) || onCluster && clusterpin.IsRedirect(aerr)) || sleepCtx(abortCtx, 50*time.Millisecond) != nil {
				break
			}
		}
		cancel()
		if aerr != nil {
			// aerr is not wrapped: callers match the rebuild's own error.
			err = fmt.Errorf("%w; and its clean-up failed (%v): its marker may hold other rebuilds off "+
				"(ErrRebuildInProgress) until it expires (Config.RebuildMarkerTTL), and its shadow keys "+
				"stay until the next Rebuild of the collection starts", err, aerr)
		}
	}
	if rep.Conflicts > 0 {
		r.logger.WarnContext(ctx, "reconcile rebuild: source rows met a live write of their version with another value; "+
			"the live write's value was kept (run the reconciler to repair it from the source)",
			slog.Int64("conflicts", rep.Conflicts))
	}
	return rep, err
}

// rebuildStepRetries bounds how often a step is retried because a layout
// key changed between reading it and running the step.
const rebuildStepRetries = 5

// switchIncomplete is the switch's reply when the copy count differs from
// the rows the copy sent (see rebuild.lua).
const switchIncomplete = 3

// errMarkerLost is ErrRebuildAborted for a rebuild whose marker is gone or
// another's.
var errMarkerLost = fmt.Errorf("%w: its marker was lost (expired or deleted)", ErrRebuildAborted)

// answered reports whether err is Redis's reply (an error reply, or one
// this package rejected), as opposed to a failure that may have lost the
// reply to a command Redis ran.
func answered(err error) bool {
	var rerr redis.Error
	if errors.As(err, &rerr) && strings.Contains(rerr.Error(), "non local key") {
		// A script Redis Cluster stopped halfway (a slot migrating under
		// it): what it wrote before stays. The probe key keeps rebuild
		// steps from starting then; should one anyway, it is uncertain.
		return false
	}
	return errors.As(err, &rerr) || errors.Is(err, projection.ErrLayoutMismatch) || errors.Is(err, ErrUnexpectedReply)
}

// rebuildStep runs one step of rebuild.lua; copied is the number of rows
// the copy sent, which the switch compares with the copy count (the other
// steps ignore it). The script needs the names of the version buckets of
// the stored live and shadow layouts, so the step reads both layout keys
// first and passes what it read; the script answers 2, touching nothing,
// if they changed in between, and the step reads them again.
//
// A live collection without a layout key whose values exist without the
// unbucketed version hash lost its layout key (the gate's "missing"): its
// bucket count is unknown, so the step passes the keys of every possible
// bucket (bucket keys are named by index alone) and the switch removes
// them all. So it does for a live layout key that holds no bucket count.
func (r *Reconciler) rebuildStep(ctx context.Context, step, token, ttl string, copied int64) (int64, error) {
	ks, kind, name := r.target.Keyspace, r.target.Kind, r.target.Name
	var (
		liveLayout, shadowLayout *redis.SliceCmd
		valueExists, flatExists  *redis.IntCmd
	)
	// One key per command: while the slot migrates, Redis refuses a
	// command of several keys split between the two masters (TRYAGAIN),
	// and go-redis's cluster pipeline then sends every command of the
	// batch again, also those it is already following an ASK with: the
	// same command runs on both masters at once (a data race on its
	// reply, which can end as the ASK error).
	queue := func(pipe redis.Pipeliner) {
		liveLayout = pipe.MGet(ctx, r.layoutKey)
		shadowLayout = pipe.MGet(ctx, ks.ShadowLayoutKey(name, kind))
		valueExists = pipe.Exists(ctx, r.valueKey)
		flatExists = pipe.Exists(ctx, r.unbucketedKey)
	}
	for range rebuildStepRetries {
		var err error
		if r.primary != nil {
			// On the master, following a slot move the client's map has
			// not caught up with (the script below follows it by itself).
			err = clusterpin.OnMaster(ctx, r.primary, r.valueKey, queue)
		} else {
			pipe := r.target.Client.Pipeline()
			queue(pipe)
			_, err = pipe.Exec(ctx)
		}
		if err != nil {
			return 0, &stepNotSentError{err}
		}
		got := append(liveLayout.Val(), shadowLayout.Val()...)
		if len(got) != 2 {
			return 0, fmt.Errorf("%w: MGET of 2 layout keys", ErrUnexpectedReply)
		}
		var (
			layouts [2]int
			args    [2]string
		)
		for i, v := range got {
			s, _ := v.(string)
			if v == nil {
				s = "0"
			}
			if layouts[i] = projection.ParseLayout(s); layouts[i] < 0 {
				if i == 1 && step != "abort" && step != "start" {
					return 0, r.mismatch(true, s)
				}
				// A layout key holding no bucket count (a hand edit) says
				// as little as a lost one: the switch removes every
				// possible live bucket, the start and the abort every
				// possible shadow one (the start clears a dead rebuild's
				// leftovers; an abort refused here would leave the
				// marker, and the gate refuses every live write while a
				// marker's shadow layout is unreadable). The script
				// compares what it stores with s, so a change meanwhile
				// is still noticed.
				layouts[i] = projection.VersionBucketsMax
			}
			args[i] = s
		}
		if got[0] == nil && valueExists.Val() == 1 && flatExists.Val() == 0 {
			layouts[0], args[0] = projection.VersionBucketsMax, "missing"
		}
		live, shadow := layouts[0], layouts[1]
		if step != "switch" {
			// Only the switch touches the live version keys; the other
			// steps need not carry them (up to 65,536 of them for a
			// collection that lost its layout key).
			live = 0
		}
		keys := []string{
			ks.RebuildMarkerKey(name, kind),
			ks.ShadowValueKey(name, kind),
			ks.ShadowLayoutKey(name, kind),
			r.valueKey,
			r.layoutKey,
			r.unbucketedKey,
			r.unbucketedShadowKey,
			ks.RebuildCopyKey(name, kind),
			rebuildSwitchedKey(ks, name, kind),
		}
		if live > 0 {
			keys = append(keys, withBuckets(ks, live).VersionKeys(name, kind)...)
		}
		if shadow > 0 {
			keys = append(keys, withBuckets(ks, shadow).ShadowVersionKeys(name, kind)...)
		}
		if r.buckets > 0 {
			keys = append(keys, ks.ShadowVersionKeys(name, kind)...)
			keys = append(keys, r.versionKeys...)
		}
		keys = append(keys, rebuildProbeKey(ks, name, kind))
		n, err := r.rebuildScript.Run(ctx, r.target.Client, keys, step, token, ttl,
			args[0], args[1], r.layout, strconv.Itoa(live), strconv.FormatInt(copied, 10), strconv.Itoa(shadow)).Int64()
		if err != nil || n != 2 {
			return n, err
		}
	}
	return 0, fmt.Errorf("%w: the collection's layout keys kept changing", ErrUnexpectedReply)
}

// stepNotSentError is a failure of the reads that precede a step's script:
// the script itself was not sent.
type stepNotSentError struct{ err error }

func (e *stepNotSentError) Error() string { return e.err.Error() }
func (e *stepNotSentError) Unwrap() error { return e.err }

// rebuildSwitchedKey returns the key in which a rebuild's switch leaves
// its token for a while (P T:z~rebuild~switched), so that a resent switch
// answers "switched" too. It shares the collection's hash tag.
func rebuildSwitchedKey(ks projection.Keyspace, name string, kind projection.Kind) string {
	return ks.RebuildMarkerKey(name, kind) + "~switched"
}

// rebuildProbeKey returns a key that never exists (P T:z~rebuild~probe),
// declared by every rebuild step. While Redis Cluster migrates the
// collection's slot, a script runs only if every key it declares is on
// the node, and checks each command it sends; one declared key that is
// always missing makes both nodes refuse the whole step up front (ASK,
// then TRYAGAIN), rather than fail it halfway, after the switch deleted
// the live keys and before it renamed the shadow keys over them.
func rebuildProbeKey(ks projection.Keyspace, name string, kind projection.Kind) string {
	return ks.RebuildMarkerKey(name, kind) + "~probe"
}

// withBuckets returns ks with n version buckets (n is a stored, checked
// layout).
func withBuckets(ks projection.Keyspace, n int) projection.Keyspace {
	out, _ := ks.WithVersionBuckets(n)
	return out
}

func (r *Reconciler) copyToShadow(ctx context.Context, rep *RebuildReport, token string, step func(context.Context, string) (bool, error)) error {
	pages, stop := r.pages(ctx, false)
	defer stop()
	lastRefresh := time.Now()
	var batch int64
	for p := range pages {
		if p.err != nil {
			return p.err
		}
		writes := make([]projection.Write, len(p.rows))
		for i := range p.rows {
			row := &p.rows[i]
			if err := r.validateRow(row); err != nil { // as Run reports it, before anything is written
				return err
			}
			writes[i] = projection.Write{Target: r.target.target(row.Key), Version: row.Version, Value: row.Value}
		}
		// The token is checked in the script that writes: a copy that
		// stalled past the marker's expiry must not land in the shadow
		// keys of a rebuild that started since. The same script counts
		// the page for the switch's check, once per batch number.
		batch++
		outcomes, err := r.gate.ApplyShadowCopy(ctx, token, batch, writes)
		if errors.Is(err, projection.ErrShadowNotOwned) {
			return errMarkerLost
		}
		if err != nil {
			return fmt.Errorf("reconcile: rebuild copy: %w", err)
		}
		rep.Rows += int64(len(writes))
		for _, o := range outcomes {
			switch o {
			case projection.OutcomeApplied:
				rep.Applied++
			case projection.OutcomeConflict:
				rep.Conflicts++
				rep.Kept++
			default:
				rep.Kept++
			}
		}
		if time.Since(lastRefresh) > r.cfg.RebuildMarkerTTL/4 {
			ok, err := step(ctx, "refresh")
			if err != nil {
				return err
			}
			if !ok {
				return errMarkerLost
			}
			lastRefresh = time.Now()
		}
	}
	return ctx.Err()
}

// sleepCtx waits d, or until ctx ends (returning its error).
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
