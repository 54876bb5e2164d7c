package reconcile

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/clusterpin"
	"github.com/verity-go/verity/projection"
)

//go:embed repair.lua
var repairSource string

// gateRepair writes the source's state for missing and stale findings
// through the projection gate, so a newer version written meanwhile wins by
// construction (the gate answers stale, duplicate or conflict and writes
// nothing).
// A document whose value or version key holds another Redis type is
// refused with nothing written, as casRepair refuses one: its finding stays
// ResultNotAttempted and its *WrongKeyTypeError is in refused.
func (r *Reconciler) gateRepair(ctx context.Context, fs []*Finding) (refused []error, err error) {
	if len(fs) == 0 {
		return nil, nil
	}
	writes := make([]projection.Write, len(fs))
	for i, f := range fs {
		writes[i] = projection.Write{Target: r.target.target(f.Key), Version: f.Source.Version, Value: f.Source.Value}
	}
	outcomes, err := r.gate.Apply(ctx, writes)
	if err != nil && r.target.Kind == projection.KindDocument && strings.Contains(err.Error(), "WRONGTYPE") {
		// The gate met a value or version key holding another type, which
		// stopped its script after the writes before it in the call.
		// Refuse those documents and send the others again: the ones the
		// first call applied come back duplicate, counted raced.
		refused, rest, terr := r.refuseWrongTyped(ctx, fs)
		if terr == nil && len(refused) > 0 {
			others, err := r.gateRepair(ctx, rest)
			return append(refused, others...), err
		}
	}
	return nil, r.settleGateRepair(fs, outcomes, err)
}

// refuseWrongTyped finds the documents of fs whose value or version key
// holds another type than a string, marks their findings
// ResultNotAttempted and returns their errors, and the other findings.
func (r *Reconciler) refuseWrongTyped(ctx context.Context, fs []*Finding) (refused []error, rest []*Finding, err error) {
	// Per document: its value key's type, then its version key's.
	keys := make([][2]string, len(fs))
	types := make([][2]*redis.StatusCmd, len(fs))
	for i, f := range fs {
		target := r.target.target(f.Key)
		keys[i] = [2]string{r.target.Keyspace.ValueKey(target), r.target.Keyspace.VersionKey(target)}
	}
	if r.primary != nil {
		// On the masters, which answered WRONGTYPE, as every read of the
		// reconciler: a lagging replica may not hold the foreign key yet.
		// One round trip per document (its keys share a slot), on this
		// rare path only.
		for i := range fs {
			if err := clusterpin.OnMaster(ctx, r.primary, keys[i][0], func(p redis.Pipeliner) {
				types[i] = [2]*redis.StatusCmd{p.Type(ctx, keys[i][0]), p.Type(ctx, keys[i][1])}
			}); err != nil {
				return nil, nil, err
			}
		}
	} else if _, err = r.target.Client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range fs {
			types[i] = [2]*redis.StatusCmd{p.Type(ctx, keys[i][0]), p.Type(ctx, keys[i][1])}
		}
		return nil
	}); err != nil {
		return nil, nil, err
	}
next:
	for i, f := range fs {
		for k, cmd := range types[i] {
			if t := cmd.Val(); t != "string" && t != "none" {
				f.Result = ResultNotAttempted
				refused = append(refused, &WrongKeyTypeError{Key: f.Key, RedisKey: keys[i][k], Type: t})
				continue next
			}
		}
		rest = append(rest, f)
	}
	return refused, rest, nil
}

// settleGateRepair sets the results of a gate repair from its outcomes or
// error.
func (r *Reconciler) settleGateRepair(fs []*Finding, outcomes []projection.Outcome, err error) error {
	if errors.Is(err, projection.ErrInvalidVersion) || errors.Is(err, projection.ErrScoreOutOfRange) ||
		errors.Is(err, projection.ErrInvalidTarget) || errors.Is(err, projection.ErrLayoutMismatch) {
		// Refused before anything was written; the findings stay
		// ResultNotAttempted.
		return fmt.Errorf("reconcile: repairing %d entries through the gate: %w", len(fs), err)
	}
	if refusedUnwritten(err) && r.oneSlotGroup(fs) {
		// One script call, refused whole. (With several, on a Cluster or
		// a Ring, the others may have been applied: uncertain below.)
		return fmt.Errorf("reconcile: repairing %d entries through the gate: %w", len(fs), err)
	}
	if err != nil && (outcomes == nil || !errors.Is(err, projection.ErrCorruptVersion)) {
		for _, f := range fs {
			f.Result = ResultUncertain
		}
		return fmt.Errorf("reconcile: repairing %d entries through the gate: %w", len(fs), err)
	}
	for i, f := range fs {
		if outcomes[i] == projection.OutcomeApplied {
			f.Result = ResultRepaired
		} else {
			// Duplicate, stale, conflict, or a version corrupted since it was read:
			// the projection changed under us, so leave it to the next run.
			f.Result = ResultRaced
		}
	}
	return nil
}

// casRepair overwrites (set) or removes (del) entries with repair.lua, only
// where the stored version and value are still what was read. Documents are
// grouped per slot; a collection's entries share one slot. A repair whose
// keys hold another Redis type is refused with nothing written: its finding
// stays ResultNotAttempted and its *WrongKeyTypeError is in refused, apart
// from err, so that the run goes on.
func (r *Reconciler) casRepair(ctx context.Context, fs []*Finding) (refused []error, err error) {
	if len(fs) == 0 {
		return nil, nil
	}
	// Overwrites before removals in each call: Redis checks maxmemory for
	// a script only until its first write, and a removal, which a full
	// Redis allows, would let the overwrites after it pass the limit. (A
	// page's findings can mix them: a row the source took back mid-pass
	// is removed as an orphan beside the page's overwrites.)
	removal := func(f *Finding) int {
		if f.Source == nil {
			return 1
		}
		return 0
	}
	fs = slices.Clone(fs)
	slices.SortStableFunc(fs, func(a, b *Finding) int { return removal(a) - removal(b) })
	kind := map[projection.Kind]string{projection.KindSortedSet: "z", projection.KindHash: "h", projection.KindDocument: "d"}[r.target.Kind]
	type group struct {
		keys     []string
		keyIndex map[string]int
		args     []any
		items    []*Finding
		// itemKeys holds each item's value and version key, to name
		// the one a refusal is about.
		itemKeys [][2]string
	}
	var groups []*group
	byKey := make(map[string]*group)
	for _, f := range fs {
		t := r.target.target(f.Key)
		gk := ""
		if r.target.Kind == projection.KindDocument {
			gk = r.groupKey(t)
		}
		g := byKey[gk]
		if g == nil {
			g = &group{args: []any{kind, r.layout}, keyIndex: make(map[string]int)}
			if r.target.Kind != projection.KindDocument {
				// Collection keys are passed once: value, layout,
				// unbucketed versions, then the buckets used.
				g.keys = []string{r.valueKey, r.layoutKey, r.unbucketedKey}
			}
			byKey[gk] = g
			groups = append(groups, g)
		}
		var base, vbase int
		if r.target.Kind == projection.KindDocument {
			g.keys = append(g.keys, r.target.Keyspace.ValueKey(t), r.target.Keyspace.VersionKey(t))
			base, vbase = len(g.keys)-1, len(g.keys)
		} else {
			vk := r.target.Keyspace.VersionKey(t)
			if vbase = g.keyIndex[vk]; vbase == 0 {
				g.keys = append(g.keys, vk)
				vbase = len(g.keys)
				g.keyIndex[vk] = vbase
			}
			base = 1
		}
		action, version, value := "del", "", any("")
		if f.Source != nil {
			action = "set"
			version = strconv.FormatInt(f.Source.Version, 10)
			if r.target.Kind == projection.KindSortedSet {
				value = strconv.FormatInt(f.Source.Value.Score, 10)
			} else {
				value = nonNil(f.Source.Value.Data)
			}
		}
		g.args = append(g.args, base, vbase, f.Key, r.expectVersion(f.Projected), r.expectValue(f.Projected), action, version, value)
		g.items = append(g.items, f)
		g.itemKeys = append(g.itemKeys, [2]string{g.keys[base-1], g.keys[vbase-1]})
	}

	cmds := make([]*redis.Cmd, len(groups))
	if len(groups) == 1 {
		cmds[0] = r.repairScript.Run(ctx, r.target.Client, groups[0].keys, groups[0].args...)
	} else {
		pipe := r.target.Client.Pipeline()
		guards := make([]string, len(groups))
		for i, g := range groups {
			guards[i] = g.keys[0]
		}
		clusterpin.Guard(ctx, r.target.Client, pipe, guards...)
		for i, g := range groups {
			cmds[i] = r.repairScript.EvalSha(ctx, pipe, g.keys, g.args...)
		}
		_, _ = pipe.Exec(ctx)
		var retry []int
		for i, cmd := range cmds {
			if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
				retry = append(retry, i)
			}
		}
		if len(retry) > 0 {
			pipe := r.target.Client.Pipeline()
			guards = guards[:0]
			for _, i := range retry {
				guards = append(guards, groups[i].keys[0])
			}
			clusterpin.Guard(ctx, r.target.Client, pipe, guards...)
			for _, i := range retry {
				cmds[i] = r.repairScript.Eval(ctx, pipe, groups[i].keys, groups[i].args...)
			}
			_, _ = pipe.Exec(ctx)
		}
	}

	var errs []error
	for i, g := range groups {
		replies, err := cmds[i].Slice()
		if lm := r.layoutError(err); lm != nil {
			// Checked before anything was written.
			errs = append(errs, fmt.Errorf("reconcile: compare-and-set repair of %d entries: %w", len(g.items), lm))
			continue
		}
		if err == nil && len(replies) != len(g.items) {
			err = fmt.Errorf("%w: %d results for %d repairs", ErrUnexpectedReply, len(replies), len(g.items))
		}
		for j := 0; err == nil && j < len(replies); j++ {
			err = checkRepairReply(replies[j])
		}
		for j, f := range g.items {
			if refusedUnwritten(err) {
				continue // f stays ResultNotAttempted
			}
			if err != nil {
				f.Result = ResultUncertain
				continue
			}
			switch reply := replies[j].(type) {
			case int64:
				f.Result = ResultRepaired
				if reply == 0 {
					f.Result = ResultRaced
				}
			case string:
				// Refused before anything was written: f stays
				// ResultNotAttempted.
				which, typ, _ := strings.Cut(reply, " ")
				key := g.itemKeys[j][0]
				if which == "version" {
					key = g.itemKeys[j][1]
				}
				refused = append(refused, &WrongKeyTypeError{Key: f.Key, RedisKey: key, Type: typ})
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("reconcile: compare-and-set repair of %d entries: %w", len(g.items), err))
		}
	}
	return refused, errors.Join(errs...)
}

// checkRepairReply accepts one element of repair.lua's reply: 1 written,
// 0 declined, or a refusal "value <type>" or "version <type>".
func checkRepairReply(reply any) error {
	switch reply := reply.(type) {
	case int64:
		if reply == 0 || reply == 1 {
			return nil
		}
	case string:
		if which, typ, ok := strings.Cut(reply, " "); ok && typ != "" && (which == "value" || which == "version") {
			return nil
		}
	}
	return fmt.Errorf("%w: repair result %v", ErrUnexpectedReply, reply)
}

// expectVersion and expectValue are what the repair script compares
// Redis's version and value with: "-" for absent, "=" and what was read,
// or, for what was read at or over Config.MaxValueBytes, "#" and its SHA-1
// in hex: "=" and a value at the limit would be one byte over it, and
// Redis would close the connection on every run (a value the projector
// accepted, or a version field a writer filled).
func (r *Reconciler) expectVersion(p Projected) string {
	if !p.HasVersion {
		return "-"
	}
	if len(p.RawVersion) >= r.cfg.MaxValueBytes {
		sum := sha1.Sum([]byte(p.RawVersion))
		return "#" + hex.EncodeToString(sum[:])
	}
	return "=" + p.RawVersion
}

func (r *Reconciler) expectValue(p Projected) any {
	if !p.HasValue {
		return "-"
	}
	if r.target.Kind == projection.KindSortedSet {
		return "=" + strconv.FormatFloat(p.Score, 'g', -1, 64)
	}
	if len(p.Data) >= r.cfg.MaxValueBytes {
		sum := sha1.Sum(p.Data)
		return "#" + hex.EncodeToString(sum[:])
	}
	return append([]byte{'='}, p.Data...)
}

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// oneSlotGroup reports whether the gate sends the repairs of fs in one
// script call: a collection's entries share its hash tag; documents do
// only when they share a slot group.
func (r *Reconciler) oneSlotGroup(fs []*Finding) bool {
	if r.target.Kind != projection.KindDocument || len(fs) < 2 {
		return true
	}
	for _, f := range fs[1:] {
		if r.groupKey(r.target.target(f.Key)) != r.groupKey(r.target.target(fs[0].Key)) {
			return false
		}
	}
	return true
}

// refusedUnwritten reports an error reply with which Redis refused a
// script before it wrote anything, so that its repairs are not attempted
// rather than uncertain: OOM, from a Redis at maxmemory with the
// noeviction policy. Redis checks maxmemory for a script only until its
// first write goes through (later writes may pass the limit), so an OOM
// reply means that none did. Also TRYAGAIN, with which Redis Cluster
// refuses a script naming several keys, before running it, on a slot
// being migrated (go-redis resends a command on TRYAGAIN, and on a
// connection that broke before the reply came, so a TRYAGAIN can answer
// the resend of an attempt that was applied: rare, as ResultNotAttempted
// says). Not READONLY: after such a break, a master demoted by a failover
// answers READONLY to the resend, the common course of a failover.
func refusedUnwritten(err error) bool {
	var reply redis.Error
	return errors.As(err, &reply) &&
		(strings.HasPrefix(reply.Error(), "OOM ") || strings.HasPrefix(reply.Error(), "TRYAGAIN "))
}
