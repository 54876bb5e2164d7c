package projection

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/clusterpin"
	"github.com/verity-go/verity/internal/deps"
)

//go:embed gate.lua
var gateSource string

// Script modes (ARGV[1] of gate.lua). modeCopy is modeShadow that also
// counts the writes (ApplyShadowCopy); the script and the metrics see it as
// "shadow".
const (
	modeLive   = "live"
	modeShadow = "shadow"
	modeCopy   = "copy"
)

// Reply codes of gate.lua. A string in place of a code is an unreadable
// stored version (not a positive int64 in canonical decimal).
const (
	replyApplied   = 1
	replyDuplicate = 2
	replyStale     = 3
	replyConflict  = 4
)

// Gate applies versioned writes to Redis atomically per Redis Cluster slot:
// a write lands only if its version is above the stored one.
//
// Apply sends one script evaluation per slot that the batch touches (one per
// batch on a single node or Sentinel), pipelined when there are several, so
// a batch costs one round trip whatever its size. A Gate is safe for
// concurrent use.
type Gate struct {
	client redis.UniversalClient
	ks     Keyspace
	script *redis.Script
	// groupKey decides which writes may share one script call: their keys
	// must live on one node (and, on Cluster, in one slot).
	groupKey func(tag string) string
	// reloadTopology, set for Cluster clients, refreshes the slot map after
	// a failed call (see eval).
	reloadTopology func(ctx context.Context)
	// metrics, set by NewRedisProjector when it has a MeterProvider, counts
	// the gate's verdicts; nil records nothing.
	metrics *projectionMetrics
	// shadowLayouts remembers, per collection (baseKey), the bucket count of
	// a running rebuild's shadow keys when it differs from ks's, so later
	// batches dual-write into that layout without a retry. A stale entry
	// costs one retry; without a rebuild the shadow keys are not used.
	shadowLayouts sync.Map
}

// NewGate returns a Gate writing through client into the keys named by ks.
// ks must come from NewKeyspace (or RedisProjector.Keyspace), NewKeyspace("")
// for no prefix: a Gate given the zero Keyspace (an uninitialised one, no
// projector's) writes nothing, and every call returns *ConfigError
// (ErrInvalidConfig) naming it, rather than write keys no reconciler is
// pointed at.
//
// client may be a single-node or Sentinel *redis.Client (one script call per
// batch), a *redis.ClusterClient (one per slot touched) or a *redis.Ring
// (one per hash tag touched; give the Ring a HeartbeatFn that always
// reports its shards up, see "Failure semantics" in the package
// documentation). Other UniversalClient implementations are treated like a
// *redis.ClusterClient, which is correct for any topology that routes by
// hash tag.
//
// On a *redis.ClusterClient a failed call also asks the client to reload
// the slot map: go-redis reloads it on MOVED/ASK but not when the master it
// knows has died, so without this the relay's retries would keep dialling
// the dead master until the client's periodic reload (60s by default)
// instead of reaching the replica that replaced it.
func NewGate(client redis.UniversalClient, ks Keyspace) *Gate {
	g := &Gate{client: client, ks: ks, script: redis.NewScript(gateSource)}
	switch c := client.(type) {
	case *redis.Client:
		g.groupKey = func(string) string { return "" }
	case *redis.Ring:
		g.groupKey = func(tag string) string { return tag }
	default:
		g.groupKey = func(tag string) string { return strconv.Itoa(KeySlot(tag)) }
		if cc, ok := c.(*redis.ClusterClient); ok {
			g.reloadTopology = cc.ReloadState
		}
	}
	return g
}

// Keyspace returns the Keyspace the gate writes into: the zero Keyspace for
// a nil *Gate.
func (g *Gate) Keyspace() Keyspace {
	if g == nil {
		return Keyspace{}
	}
	return g.ks
}

// Load loads the gate script into the script cache of the servers the
// client writes to: every node a *redis.ClusterClient knows, replicas
// included (go-redis sends SCRIPT LOAD to each, so one that cannot be
// reached fails Load), every shard of a *redis.Ring that the Ring counts
// as up (a Ring with none, closed or every shard down, fails Load), the
// server of any other client. It is optional: Apply falls back
// to EVAL when a node answers NOSCRIPT (after a restart or failover).
func (g *Gate) Load(ctx context.Context) error {
	if err := g.unusable(); err != nil {
		return err
	}
	var err error
	if ring, ok := g.client.(*redis.Ring); ok {
		// A Ring sends a command without keys, SCRIPT LOAD included, to
		// one shard picked at random.
		err = forEachRingShard(ctx, ring, func(ctx context.Context, shard *redis.Client) error {
			return g.script.Load(ctx, shard).Err()
		})
	} else {
		err = g.script.Load(ctx, g.client).Err()
	}
	if err != nil {
		return fmt.Errorf("projection: load gate script: %w", err)
	}
	return nil
}

// Apply gates writes, in order, and returns one Outcome per write.
//
// Every write is validated before anything is sent: an invalid version,
// score or target returns its typed error (*InvalidVersionError,
// *ScoreOutOfRangeError, *InvalidTargetError) and writes nothing.
//
// Writes to the same target within one batch are applied in batch order,
// so a lower version after a higher one is stale. For a collection whose
// rebuild marker exists, each write is also applied to the shadow keys by
// the same rule; that outcome is not reported.
//
// A write whose stored version is unreadable (not a positive int64 in
// canonical decimal) is refused: its Outcome is OutcomeUnknown and the
// returned error joins one *CorruptVersionError per such write
// (errors.Is(err, ErrCorruptVersion)); the other outcomes are valid.
//
// A collection whose stored version layout differs from the Keyspace's
// fails the call with *LayoutMismatchError; nothing was written in that
// collection's slot group, but other slot groups (on Cluster or a Ring) may
// have been applied. Any other error means the batch's effect is unknown:
// some slot groups may have been applied, and a group that Redis failed
// part-way (WRONGTYPE, when a key holds another type) keeps the writes
// its script made before the error. When several slot groups fail, the
// error is the first's. Applying the batch again is always safe.
func (g *Gate) Apply(ctx context.Context, writes []Write) ([]Outcome, error) {
	return joinRun(g.run(ctx, modeLive, "", writes, false))
}

// ApplyShadow is Apply for the shadow keys of a running rebuild: each
// write is gated against, and written to, only the shadow value and
// version keys of its collection, without overwriting newer versions that
// live writes dual-wrote meanwhile. A rebuild copies through
// ApplyShadowCopy, which also counts what it writes.
// Document targets are refused with *InvalidTargetError (documents have no
// shadow keys).
//
// token is the rebuild's: in the same script, a collection whose rebuild
// marker does not hold it is refused with ErrShadowNotOwned and nothing is
// written to it, so a rebuild that stalled past its marker's expiry cannot
// write its stale rows into the shadow keys of the rebuild that followed.
// An empty token skips that check (for tools that own the shadow keys some
// other way). ApplyShadowCopy also counts the writes, so that a rebuild
// can verify that Redis still holds them at its switch.
func (g *Gate) ApplyShadow(ctx context.Context, token string, writes []Write) ([]Outcome, error) {
	if err := g.unusable(); err != nil { // first, as for every call
		return nil, err
	}
	if err := checkShadow(token, writes); err != nil {
		return nil, err
	}
	return joinRun(g.run(ctx, modeShadow, token, writes, false))
}

// ApplyShadowCopy is ApplyShadow for one batch of a rebuild's copy, with
// the rebuild's token (required) and a count: in the same script that
// writes them, it adds the number of writes the batch sends to each
// collection — every one, applied or kept — to that collection's copy
// count (Keyspace.RebuildCopyKey). Redis therefore keeps the count and the
// rows together or loses them together, and a rebuild that compares the
// count with what it sent can tell a shadow that lost writes (a failover
// to a replica that missed some, a restart from an older snapshot) from a
// complete one. Live writes dual-written into the shadow keys are not
// counted there; every shadow write, copied or dual-written, counts in the
// same key the members and versions it creates, for the switch (see
// package reconcile).
//
// batch numbers the call: positive, and higher than that of the rebuild's
// previous call. A call whose batch is not above the last one counted is
// written but not counted again, so a call that ran but whose reply was
// lost (and that the client retried) is counted once.
func (g *Gate) ApplyShadowCopy(ctx context.Context, token string, batch int64, writes []Write) ([]Outcome, error) {
	if err := g.unusable(); err != nil { // first, as for every call
		return nil, err
	}
	if err := checkShadow(token, writes); err != nil {
		return nil, err
	}
	if token == "" {
		return nil, &ConfigError{Field: "token", Reason: "is empty: a counted shadow copy needs the rebuild's token"}
	}
	if batch <= 0 {
		return nil, &ConfigError{Field: "batch", Reason: fmt.Sprintf("is %d: a counted shadow copy needs a positive batch number, higher than the rebuild's previous one", batch)}
	}
	return joinRun(g.run(ctx, modeCopy, token+" "+strconv.FormatInt(batch, 10), writes, false))
}

// checkShadow refuses shadow writes to documents and a token with a space
// (which would split ARGV[1] of gate.lua wrongly).
func checkShadow(token string, writes []Write) error {
	for i := range writes {
		if writes[i].Target.Kind == KindDocument {
			return &InvalidTargetError{Index: i, Target: writes[i].Target, Reason: "documents have no rebuild shadow keys"}
		}
	}
	if strings.ContainsAny(token, " ") {
		return &ConfigError{Field: "token", Reason: fmt.Sprintf("%q contains a space, which a rebuild token must not", token)}
	}
	return nil
}

// joinRun folds run's per-write errors into one error for Apply's callers.
func joinRun(outcomes []Outcome, perWrite []error, err error) ([]Outcome, error) {
	if err != nil {
		return nil, err
	}
	if errs := compact(perWrite); len(errs) > 0 {
		return outcomes, errors.Join(errs...)
	}
	return outcomes, nil
}

// layoutRetries bounds how often one Apply rebuilds a collection's shadow
// keys after learning that a running rebuild uses another bucket count.
const layoutRetries = 3

// run validates and applies writes. token follows the mode in ARGV[1]: the
// rebuild's token, and for modeCopy its batch number after a space.
//
// An error with nil outcomes means nothing was sent: the Gate has no client,
// or a write is invalid. Otherwise run returns one Outcome and one error per
// write, nil unless the write has OutcomeUnknown: a *CorruptVersionError
// (its stored version is unreadable), an error that isolate makes the
// write's own (below), or the error that failed the script call of the
// write's slot group (a Redis error such as a node down or a timeout,
// ErrShadowNotOwned, ErrUnexpectedReply, and without isolate a
// *LayoutMismatchError). Such a write's effect is unknown (the call may
// have run) and it is not counted among the gate's verdicts, nor are the
// group's other writes (with isolate, a WRONGTYPE keeps the verdicts of
// the writes before it; see WrongKeyTypeError). A failed call does not
// hold back the other slot groups: their verdicts stand and are counted. Without isolate, the first failed call's error
// is also returned, and Apply fails the batch with it; with isolate, run
// returns no error once it has sent the batch.
//
// isolate turns a collection's layout mismatch from a call failure into a
// per-write *LayoutMismatchError for that collection's writes only; the
// rest of its slot group is sent again (the script refused the whole
// group before writing), so one misconfigured collection cannot hold back
// the others. It also turns a WRONGTYPE error (a key holding another type)
// into a per-write *WrongKeyTypeError. Redis keeps what a failed script
// wrote before its error, so gate.lua reports the verdicts of the writes
// it finished: those stand (a write it applied is applied, not a
// duplicate on a second try), the write it stopped at gets the error, and
// the writes after it are sent again, each in a group of its own and all
// in one round trip, so that any other bad key is found alone. An error
// before the script's first write sends every write of the group again
// that way.
func (g *Gate) run(ctx context.Context, mode, token string, writes []Write, isolate bool) ([]Outcome, []error, error) {
	if err := g.unusable(); err != nil {
		return nil, nil, err
	}
	for i := range writes {
		if err := validateWrite(i, &writes[i]); err != nil {
			return nil, nil, err
		}
	}
	outcomes := make([]Outcome, len(writes))
	perWrite := make([]error, len(writes))
	if len(writes) == 0 {
		return outcomes, perWrite, nil
	}
	pending := make([]int, len(writes))
	for i := range pending {
		pending[i] = i
	}
	metricsMode := mode
	if mode == modeCopy {
		metricsMode = modeShadow
	}
	start := time.Now()
	defer func() { g.metrics.recordBatch(ctx, metricsMode, time.Since(start)) }()
	// A failed script call leaves its writes undecided; undecided (made on
	// the first failure, so a batch without one does not pay for it)
	// keeps them out of the verdicts counted below.
	var (
		undecided []bool
		firstErr  error
	)
	callFailed := func(index []int, err error) {
		if undecided == nil {
			undecided = make([]bool, len(writes))
		}
		for _, i := range index {
			outcomes[i], perWrite[i], undecided[i] = OutcomeUnknown, err, true
		}
		if firstErr == nil {
			firstErr = err
		}
	}
	relearned := make(map[baseKey]int) // shadow layouts learnt per collection
	var alone map[int]bool             // writes sent in a group of their own
	for len(pending) > 0 {
		groups := g.groupAlone(mode, token, writes, pending, alone)
		replies, errs := g.eval(ctx, groups)
		pending = nil
		for gi, grp := range groups {
			codes, err := replies[gi], errs[gi]
			done := -1 // writes the script finished before err, if it says
			if n := len(codes); err == nil && n > 0 {
				if rerr, ok := codes[n-1].(redis.Error); ok {
					codes, err, done = codes[:n-1], rerr, n-1
				}
			}
			if err != nil {
				if isNotOwnedReply(err) {
					callFailed(grp.index, ErrShadowNotOwned) // refused before any write
					continue
				}
				lr, ok := parseLayoutReply(err, grp)
				switch {
				case !ok && isolate && isWrongType(err) && done < len(grp.index):
					rest := grp.index
					if done >= 0 || len(rest) == 1 {
						// The script stopped at write done (0 when alone).
						done = max(done, 0)
						if derr := decodeReplies(writes, grp.index[:done], codes, outcomes, perWrite); derr != nil {
							callFailed(grp.index, derr)
							continue
						}
						i := grp.index[done]
						perWrite[i] = &WrongKeyTypeError{Index: i, Target: writes[i].Target, Err: err}
						rest = grp.index[done+1:]
					}
					if alone == nil {
						alone = make(map[int]bool)
					}
					for _, i := range rest {
						alone[i] = true
					}
					pending = append(pending, rest...)
					continue
				case !ok:
					// The whole group's effect is unknown (the call may
					// have run). Even writes the script reports finished
					// are not kept: on a node that refuses writes
					// (READONLY: a demoted master) their duplicate
					// verdicts may rest on data a resync discards, and a
					// retry costs only a duplicate.
					callFailed(grp.index, g.failed(ctx, err))
					continue
				case lr.shadow && mode == modeLive && lr.stored >= 0 && relearned[lr.coll] < layoutRetries:
					// A rebuild fills shadows in another layout: dual-write
					// into its layout (remembered for later batches). The
					// script checked before writing, so the group wrote
					// nothing and is sent again.
					relearned[lr.coll]++
					g.shadowLayouts.Store(lr.coll, lr.stored)
					pending = append(pending, grp.index...)
					continue
				case isolate:
					// Each round refuses at least one collection, so this
					// ends; groups without a mismatch cost nothing more.
					lm := lr.mismatch(g.ks.buckets)
					for _, i := range grp.index {
						if (baseKey{kind: writes[i].Target.Kind, name: writes[i].Target.Name}) == lr.coll {
							perWrite[i] = lm
						} else {
							pending = append(pending, i)
						}
					}
					continue
				default:
					// Refused before any write: the whole group.
					callFailed(grp.index, lr.mismatch(g.ks.buckets))
					continue
				}
			}
			if err := decodeReplies(writes, grp.index, codes, outcomes, perWrite); err != nil {
				callFailed(grp.index, err)
			}
		}
	}
	g.metrics.recordWrites(ctx, metricsMode, writes, outcomes, undecided)
	if isolate {
		return outcomes, perWrite, nil
	}
	return outcomes, perWrite, firstErr
}

// decodeReplies sets the outcome, or the *CorruptVersionError, of the
// writes at positions index from gate.lua's reply codes, one per write.
func decodeReplies(writes []Write, index []int, codes []any, outcomes []Outcome, perWrite []error) error {
	if len(codes) != len(index) {
		return fmt.Errorf("%w: %d results for %d writes", ErrUnexpectedReply, len(codes), len(index))
	}
	for j, reply := range codes {
		i := index[j]
		switch reply {
		case int64(replyApplied):
			outcomes[i] = OutcomeApplied
		case int64(replyDuplicate):
			outcomes[i] = OutcomeDuplicate
		case int64(replyStale):
			outcomes[i] = OutcomeStale
		case int64(replyConflict):
			outcomes[i] = OutcomeConflict
		default:
			stored, ok := reply.(string)
			if !ok {
				return fmt.Errorf("%w: result %v (%T)", ErrUnexpectedReply, reply, reply)
			}
			perWrite[i] = &CorruptVersionError{Index: i, Target: writes[i].Target, Stored: stored}
		}
	}
	return nil
}

// isNotOwnedReply reports gate.lua's refusal of a shadow write whose
// rebuild token the marker does not hold.
func isNotOwnedReply(err error) bool {
	return strings.HasPrefix(err.Error(), "VERITY_NOT_OWNED")
}

// layoutReply is a decoded "VERITY_LAYOUT" error of gate.lua.
type layoutReply struct {
	coll   baseKey
	shadow bool
	stored int // -1: not a bucket count
}

func (lr layoutReply) mismatch(configured int) *LayoutMismatchError {
	return &LayoutMismatchError{Kind: lr.coll.kind, Name: lr.coll.name, Shadow: lr.shadow, Stored: lr.stored, Configured: configured}
}

// parseLayoutReply decodes gate.lua's layout error, "VERITY_LAYOUT
// <live|shadow> <base> <stored>", for the collection at KEYS[base] of grp.
// <stored> is the rest of the reply, spaces and all ("" if absent), so a
// foreign value is unreadable (-1) rather than split into another reply.
func parseLayoutReply(err error, grp *slotGroup) (layoutReply, bool) {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return layoutReply{}, false
	}
	f := strings.SplitN(rerr.Error(), " ", 4)
	if len(f) < 3 || f[0] != "VERITY_LAYOUT" {
		return layoutReply{}, false
	}
	base, err := strconv.Atoi(f[2])
	coll, ok := grp.collAt[base]
	if err != nil || !ok {
		return layoutReply{}, false
	}
	stored := -1
	if len(f) == 4 {
		stored = ParseLayout(f[3])
	}
	return layoutReply{coll: coll, shadow: f[1] == "shadow", stored: stored}, true
}

// ParseLayout returns the bucket count a layout key holds, or -1 when s is
// not a canonical decimal within [0, VersionBucketsMax].
func ParseLayout(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || n > VersionBucketsMax || strconv.Itoa(n) != s {
		return -1
	}
	return n
}

// slotGroup is the part of a batch sent in one script call.
type slotGroup struct {
	keys     []string
	keyIndex map[bucketRef]int // version bucket → 1-based KEYS index (bucketed layouts only)
	// args is ARGV: mode, collection count, five or seven arguments per
	// write, then base, live layout and shadow layout per collection (see
	// gate.lua); the headers are appended once every write is in.
	args    []any
	headers []any
	index   []int // batch position of each write in the group
	bases   map[baseKey]collKeys
	collAt  map[int]baseKey // base → collection, to decode layout errors
}

// collKeys is where one collection's keys start in a group's KEYS, and the
// keyspace its shadow version keys are named in.
type collKeys struct {
	base    int
	shadows Keyspace
}

// bucketRef names one version bucket of a collection in a group: the
// collection's base, live or shadow, and the bucket number.
type bucketRef struct {
	base, bucket int
	shadow       bool
}

// bucketKey returns the KEYS index of bucket b of the collection at base
// (its shadow when shadow is set), naming the key with ks on first use
// only: building key strings per write would cost more than the lookup.
func (grp *slotGroup) bucketKey(ks Keyspace, t Target, base, b int, shadow bool) int {
	ref := bucketRef{base: base, bucket: b, shadow: shadow}
	if i, ok := grp.keyIndex[ref]; ok {
		return i
	}
	if grp.keyIndex == nil {
		grp.keyIndex = make(map[bucketRef]int)
	}
	k := ks.versionKey(t.Name, t.Kind, b)
	if shadow {
		k += suffixShadow
	}
	grp.keys = append(grp.keys, k)
	grp.keyIndex[ref] = len(grp.keys)
	return len(grp.keys)
}

// baseKey identifies the keys a write uses: one collection, or one document.
type baseKey struct {
	kind Kind
	name string
}

// shadowKeyspace is the keyspace of coll's shadow keys: a running rebuild's
// layout once learnt, the gate's own until then.
func (g *Gate) shadowKeyspace(mode string, coll baseKey) Keyspace {
	if mode == modeLive {
		if n, ok := g.shadowLayouts.Load(coll); ok {
			return Keyspace{prefix: g.ks.prefix, buckets: n.(int), made: true}
		}
	}
	return g.ks
}

// baseKeys returns where bk's keys start in grp's KEYS, adding them to
// grp on bk's first write there.
func (g *Gate) baseKeys(mode string, grp *slotGroup, t Target, bk baseKey) collKeys {
	if ck, ok := grp.bases[bk]; ok {
		return ck
	}
	ck := collKeys{base: len(grp.keys) + 1} // KEYS is 1-based in Lua
	if t.Kind.isCollection() {
		ck.shadows = g.shadowKeyspace(mode, bk)
		grp.keys = append(grp.keys,
			g.ks.ValueKey(t),
			g.ks.LayoutKey(t.Name, t.Kind),
			g.ks.RebuildMarkerKey(t.Name, t.Kind),
			g.ks.ShadowValueKey(t.Name, t.Kind),
			g.ks.ShadowLayoutKey(t.Name, t.Kind),
			g.ks.unbucketedVersionKey(t.Name, t.Kind),
			g.ks.unbucketedVersionKey(t.Name, t.Kind)+suffixShadow,
			// Every shadow write counts the members and versions it
			// creates there, which the rebuild's switch checks.
			g.ks.RebuildCopyKey(t.Name, t.Kind))
		if grp.collAt == nil {
			grp.collAt = make(map[int]baseKey)
		}
		grp.collAt[ck.base] = bk
		grp.headers = append(grp.headers, ck.base, strconv.Itoa(g.ks.buckets), strconv.Itoa(ck.shadows.buckets))
	} else {
		grp.keys = append(grp.keys, g.ks.ValueKey(t), g.ks.VersionKey(t))
	}
	grp.bases[bk] = ck
	return ck
}

// groupAlone is group, except that the writes in alone each get a slot
// group of their own.
func (g *Gate) groupAlone(mode, token string, writes []Write, idx []int, alone map[int]bool) []*slotGroup {
	if len(alone) == 0 {
		return g.group(mode, token, writes, idx)
	}
	var together, single []int
	for _, i := range idx {
		if alone[i] {
			single = append(single, i)
		} else {
			together = append(together, i)
		}
	}
	groups := g.group(mode, token, writes, together)
	for _, i := range single {
		groups = append(groups, g.group(mode, token, writes, []int{i})...)
	}
	return groups
}

// group splits the writes at positions idx into script calls.
func (g *Gate) group(mode, token string, writes []Write, idx []int) []*slotGroup {
	var groups []*slotGroup
	byKey := make(map[string]*slotGroup)
	// Runs of writes to one collection are the common case: the previous
	// write's group and keys serve the next one of the same target without
	// building its hash tag and looking both up again.
	var (
		lastBase  baseKey
		lastGroup *slotGroup
		lastKeys  collKeys
	)
	for _, i := range idx {
		w := &writes[i]
		t := w.Target
		bk := baseKey{kind: t.Kind, name: t.Name}
		if lastGroup == nil || bk != lastBase {
			gk := g.groupKey(g.ks.HashTag(t))
			grp := byKey[gk]
			if grp == nil {
				// Room for the whole batch in the first group only (the
				// common case: one group); later ones grow as they fill,
				// so a batch over many slots costs memory linear in it.
				capacity := 2 + 5*len(idx)
				if len(groups) > 0 {
					capacity = 7
				}
				grp = &slotGroup{bases: make(map[baseKey]collKeys), args: make([]any, 2, capacity)}
				arg := mode
				if mode == modeCopy {
					arg = modeShadow // the script knows a copy by its batch
				}
				if token != "" {
					arg += " " + token
				}
				grp.args[0] = arg
				byKey[gk] = grp
				groups = append(groups, grp)
			}
			lastBase, lastGroup, lastKeys = bk, grp, g.baseKeys(mode, grp, t, bk)
		}
		grp, ck := lastGroup, lastKeys
		base := ck.base
		var kind string
		var value any
		switch t.Kind {
		case KindSortedSet:
			kind, value = "z", strconv.FormatInt(w.Value.Score, 10)
		case KindHash:
			kind, value = "h", nonNil(w.Value.Data)
		case KindDocument:
			kind, value = "d", nonNil(w.Value.Data)
		}
		if t.Kind.isCollection() && (g.ks.buckets > 0 || ck.shadows.buckets > 0) {
			// Bucketed: seven arguments, with the KEYS indexes of the
			// member's version and shadow version buckets.
			vi, svi := base+5, base+6 // the unbucketed hashes
			if g.ks.buckets > 0 {
				vi = grp.bucketKey(g.ks, t, base, g.ks.VersionBucket(t.Member), false)
			}
			if ck.shadows.buckets > 0 {
				svi = grp.bucketKey(ck.shadows, t, base, ck.shadows.VersionBucket(t.Member), true)
			}
			grp.args = append(grp.args, bucketedKind[kind], base, vi, svi, t.Member, strconv.FormatInt(w.Version, 10), value)
		} else {
			// Five arguments, in the order gate.lua reads them.
			grp.args = append(grp.args, kind, base, t.Member, strconv.FormatInt(w.Version, 10), value)
		}
		grp.index = append(grp.index, i)
	}
	for _, grp := range groups {
		grp.args[1] = len(grp.headers) / 3
		grp.args = append(grp.args, grp.headers...)
	}
	return groups
}

// bucketedKind is the kind argument of a seven-argument (bucketed) write.
var bucketedKind = map[string]string{"z": "Z", "h": "H"}

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// eval runs one script call per group: directly for one group, pipelined
// for several. A NOSCRIPT answer (script cache flushed, or a node that has
// never seen the script) is retried with EVAL, which also caches it. It
// returns each group's reply or error.
func (g *Gate) eval(ctx context.Context, groups []*slotGroup) ([][]any, []error) {
	replies := make([][]any, len(groups))
	errs := make([]error, len(groups))
	if len(groups) == 1 {
		replies[0], errs[0] = g.script.Run(ctx, g.client, groups[0].keys, groups[0].args...).Slice()
		return replies, errs
	}
	cmds := make([]*redis.Cmd, len(groups))
	guards := make([]string, len(groups))
	for i, grp := range groups {
		guards[i] = grp.keys[0]
	}
	pipe := g.client.Pipeline()
	clusterpin.Guard(ctx, g.client, pipe, guards...)
	for i, grp := range groups {
		cmds[i] = g.script.EvalSha(ctx, pipe, grp.keys, grp.args...)
	}
	_, _ = pipe.Exec(ctx) // errors are inspected per command below
	var retry []int
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			retry = append(retry, i)
		}
	}
	if len(retry) > 0 {
		pipe := g.client.Pipeline()
		guards = guards[:0]
		for _, i := range retry {
			guards = append(guards, groups[i].keys[0])
		}
		clusterpin.Guard(ctx, g.client, pipe, guards...)
		for _, i := range retry {
			cmds[i] = g.script.Eval(ctx, pipe, groups[i].keys, groups[i].args...)
		}
		_, _ = pipe.Exec(ctx)
	}
	for i, cmd := range cmds {
		replies[i], errs[i] = cmd.Slice()
	}
	return replies, errs
}

// unusable refuses, before anything is sent, a Gate that was not made by
// NewGate with a client, or was made with the zero Keyspace (NewGate
// returns no error, so its calls report it).
func (g *Gate) unusable() error {
	switch {
	case g == nil || deps.Missing(g.client) || g.script == nil:
		return &ConfigError{Field: "client", Reason: "is nil: the Gate has no Redis client; create it with NewGate(client, keyspace)"}
	case g.ks.IsZero():
		return &ConfigError{Field: "keyspace", Reason: "is the zero Keyspace, which no projector writes with; pass NewGate the projector's Keyspace(), or projection.NewKeyspace(prefix) (\"\" for no prefix)"}
	}
	return nil
}

// isWrongType reports whether err is Redis's WRONGTYPE error, raised by a
// command of the script (Redis 7 replies with it as it is; earlier
// versions wrap it in "ERR Error running script").
func isWrongType(err error) bool {
	var rerr redis.Error
	return errors.As(err, &rerr) && strings.Contains(rerr.Error(), "WRONGTYPE Operation against a key holding the wrong kind of value")
}

// failed wraps a script call's error and, on Cluster, schedules a slot-map
// reload (asynchronous and de-duplicated by go-redis, so cheap) unless the
// caller cancelled: a caller's deadline is all go-redis reports of a master
// that stopped answering (a lost host) when it is shorter than ReadTimeout.
func (g *Gate) failed(ctx context.Context, err error) error {
	if g.reloadTopology != nil && !errors.Is(ctx.Err(), context.Canceled) {
		g.reloadTopology(ctx)
	}
	return fmt.Errorf("projection: gate script: %w", err)
}
