package projection

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

//go:embed gate.lua
var gateSource string

// Script modes (ARGV[1] of gate.lua).
const (
	modeLive   = "live"
	modeShadow = "shadow"
)

// Reply codes of gate.lua. A string in place of a code is an unreadable
// stored version.
const (
	replyApplied   = 1
	replyDuplicate = 2
	replyStale     = 3
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
}

// NewGate returns a Gate writing through client into the keys named by ks.
//
// client may be a single-node or Sentinel *redis.Client (one script call per
// batch), a *redis.ClusterClient (one per slot touched) or a *redis.Ring
// (one per hash tag touched). Other UniversalClient implementations are
// treated like a *redis.ClusterClient, which is correct for any topology
// that routes by hash tag.
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

// Keyspace returns the Keyspace the gate writes into.
func (g *Gate) Keyspace() Keyspace { return g.ks }

// Load loads the gate script into the script cache of the node(s) the
// client reaches. It is optional: Apply falls back to EVAL when a node
// answers NOSCRIPT (after a restart or failover).
func (g *Gate) Load(ctx context.Context) error {
	if err := g.script.Load(ctx, g.client).Err(); err != nil {
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
// A write whose stored version is unreadable is refused: its Outcome is
// OutcomeUnknown and the returned error joins one *CorruptVersionError per
// such write (errors.Is(err, ErrCorruptVersion)); the other outcomes are
// valid. Any other error means the batch's effect is unknown: some slot
// groups may have been applied. Applying the batch again is always safe.
func (g *Gate) Apply(ctx context.Context, writes []Write) ([]Outcome, error) {
	return joinRun(g.run(ctx, modeLive, writes))
}

// ApplyShadow is Apply for the shadow keys of a running rebuild: each
// write is gated against, and written to, only the shadow value and
// version keys of its collection, whether or not the marker exists. It is
// how a rebuild copies source state without overwriting newer versions
// that live writes dual-wrote meanwhile. Document targets are refused with
// *InvalidTargetError (documents have no shadow keys).
func (g *Gate) ApplyShadow(ctx context.Context, writes []Write) ([]Outcome, error) {
	for i := range writes {
		if writes[i].Target.Kind == KindDocument {
			return nil, &InvalidTargetError{Index: i, Target: writes[i].Target, Reason: "documents have no rebuild shadow keys"}
		}
	}
	return joinRun(g.run(ctx, modeShadow, writes))
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

// run validates and applies writes. It returns either a batch error, or
// the outcomes together with a per-write error slice (nil entries except
// for writes refused because their stored version is unreadable).
func (g *Gate) run(ctx context.Context, mode string, writes []Write) ([]Outcome, []error, error) {
	if g == nil || g.client == nil || g.script == nil {
		return nil, nil, errors.New("projection: Gate has no Redis client; create it with NewGate(client, keyspace)")
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
	groups := g.group(mode, writes)
	start := time.Now()
	replies, err := g.eval(ctx, groups)
	g.metrics.recordBatch(ctx, mode, time.Since(start))
	if err != nil {
		return nil, nil, err
	}
	for gi, grp := range groups {
		codes := replies[gi]
		if len(codes) != len(grp.index) {
			return nil, nil, fmt.Errorf("%w: %d results for %d writes", ErrUnexpectedReply, len(codes), len(grp.index))
		}
		for j, reply := range codes {
			i := grp.index[j]
			switch reply {
			case int64(replyApplied):
				outcomes[i] = OutcomeApplied
			case int64(replyDuplicate):
				outcomes[i] = OutcomeDuplicate
			case int64(replyStale):
				outcomes[i] = OutcomeStale
			default:
				stored, ok := reply.(string)
				if !ok {
					return nil, nil, fmt.Errorf("%w: result %v (%T)", ErrUnexpectedReply, reply, reply)
				}
				perWrite[i] = &CorruptVersionError{Index: i, Target: writes[i].Target, Stored: stored}
			}
		}
	}
	g.metrics.recordWrites(ctx, mode, writes, outcomes)
	return outcomes, perWrite, nil
}

// slotGroup is the part of a batch sent in one script call.
type slotGroup struct {
	keys  []string
	args  []any
	index []int // batch position of each write in the group
	bases map[baseKey]int
}

// baseKey identifies the keys a write uses: one collection, or one document.
type baseKey struct {
	kind Kind
	name string
}

func (g *Gate) group(mode string, writes []Write) []*slotGroup {
	var groups []*slotGroup
	byKey := make(map[string]*slotGroup)
	for i := range writes {
		w := &writes[i]
		gk := g.groupKey(g.ks.HashTag(w.Target))
		grp := byKey[gk]
		if grp == nil {
			grp = &slotGroup{args: []any{mode}, bases: make(map[baseKey]int)}
			byKey[gk] = grp
			groups = append(groups, grp)
		}
		bk := baseKey{kind: w.Target.Kind, name: w.Target.Name}
		base, ok := grp.bases[bk]
		if !ok {
			base = len(grp.keys) + 1 // KEYS is 1-based in Lua
			grp.bases[bk] = base
			grp.keys = append(grp.keys, g.ks.ValueKey(w.Target), g.ks.VersionKey(w.Target))
			if w.Target.Kind.isCollection() {
				grp.keys = append(grp.keys,
					g.ks.RebuildMarkerKey(w.Target.Name, w.Target.Kind),
					g.ks.ShadowValueKey(w.Target.Name, w.Target.Kind),
					g.ks.ShadowVersionKey(w.Target.Name, w.Target.Kind))
			}
		}
		var kind string
		var value any
		switch w.Target.Kind {
		case KindSortedSet:
			kind, value = "z", strconv.FormatInt(w.Value.Score, 10)
		case KindHash:
			kind, value = "h", nonNil(w.Value.Data)
		case KindDocument:
			kind, value = "d", nonNil(w.Value.Data)
		}
		// Five arguments per write, in the order gate.lua reads them.
		grp.args = append(grp.args, kind, base, w.Target.Member, strconv.FormatInt(w.Version, 10), value)
		grp.index = append(grp.index, i)
	}
	return groups
}

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// eval runs one script call per group: directly for one group, pipelined
// for several. A NOSCRIPT answer (script cache flushed, or a node that has
// never seen the script) is retried with EVAL, which also caches it.
func (g *Gate) eval(ctx context.Context, groups []*slotGroup) ([][]any, error) {
	replies := make([][]any, len(groups))
	if len(groups) == 1 {
		codes, err := g.script.Run(ctx, g.client, groups[0].keys, groups[0].args...).Slice()
		if err != nil {
			return nil, g.failed(ctx, err)
		}
		replies[0] = codes
		return replies, nil
	}
	cmds := make([]*redis.Cmd, len(groups))
	pipe := g.client.Pipeline()
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
		for _, i := range retry {
			cmds[i] = g.script.Eval(ctx, pipe, groups[i].keys, groups[i].args...)
		}
		_, _ = pipe.Exec(ctx)
	}
	for i, cmd := range cmds {
		codes, err := cmd.Slice()
		if err != nil {
			return nil, g.failed(ctx, err)
		}
		replies[i] = codes
	}
	return replies, nil
}

// failed wraps a script call's error and, on Cluster, schedules a slot-map
// reload (asynchronous and de-duplicated by go-redis, so cheap) unless the
// caller gave up.
func (g *Gate) failed(ctx context.Context, err error) error {
	if g.reloadTopology != nil && ctx.Err() == nil {
		g.reloadTopology(ctx)
	}
	return fmt.Errorf("projection: gate script: %w", err)
}
