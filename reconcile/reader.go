package reconcile

import (
	"context"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/projection"
)

// read returns what the projection holds for each key, in order, in one
// round trip: ZMSCORE + HMGET for a sorted set, HMGET + HMGET for a hash
// (both keys share a slot), and for documents one MGET per slot (per
// node on a single server), all pipelined.
func (r *Reconciler) read(ctx context.Context, keys []string) ([]Projected, error) {
	out := make([]Projected, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	if r.target.Kind == projection.KindDocument {
		return out, r.readDocuments(ctx, keys, out)
	}
	members := make([]any, len(keys))
	for i, k := range keys {
		members[i] = k
	}
	pipe := r.target.Client.Pipeline()
	var values *redis.Cmd
	if r.target.Kind == projection.KindSortedSet {
		// Raw command: the typed ZMScore maps a missing member to 0.
		values = pipe.Do(ctx, append([]any{"ZMSCORE", r.valueKey}, members...)...)
	} else {
		values = pipe.Do(ctx, append([]any{"HMGET", r.valueKey}, members...)...)
	}
	versions := pipe.Do(ctx, append([]any{"HMGET", r.versionKey}, members...)...)
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("reconcile: reading projection: %w", err)
	}
	vals, err1 := values.Slice()
	vers, err2 := versions.Slice()
	if err1 != nil || err2 != nil || len(vals) != len(keys) || len(vers) != len(keys) {
		return nil, fmt.Errorf("%w: reading %d projection entries", ErrUnexpectedReply, len(keys))
	}
	for i := range keys {
		if err := r.fillValue(&out[i], vals[i]); err != nil {
			return nil, err
		}
		if err := fillVersion(&out[i], vers[i]); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// readDocuments reads value and version of each document with MGET, one
// MGET per slot group.
func (r *Reconciler) readDocuments(ctx context.Context, keys []string, out []Projected) error {
	type group struct {
		keys  []any
		index []int
	}
	var groups []*group
	byKey := make(map[string]*group)
	for i, k := range keys {
		t := r.target.target(k)
		gk := r.groupKey(t)
		g := byKey[gk]
		if g == nil {
			g = &group{keys: []any{"MGET"}}
			byKey[gk] = g
			groups = append(groups, g)
		}
		g.keys = append(g.keys, r.target.Keyspace.ValueKey(t), r.target.Keyspace.VersionKey(t))
		g.index = append(g.index, i)
	}
	pipe := r.target.Client.Pipeline()
	cmds := make([]*redis.Cmd, len(groups))
	for gi, g := range groups {
		cmds[gi] = pipe.Do(ctx, g.keys...)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("reconcile: reading projection: %w", err)
	}
	for gi, g := range groups {
		vals, err := cmds[gi].Slice()
		if err != nil || len(vals) != 2*len(g.index) {
			return fmt.Errorf("%w: MGET of %d documents", ErrUnexpectedReply, len(g.index))
		}
		for j, i := range g.index {
			if err := r.fillValue(&out[i], vals[2*j]); err != nil {
				return err
			}
			if err := fillVersion(&out[i], vals[2*j+1]); err != nil {
				return err
			}
		}
	}
	return nil
}

// groupKey decides which documents may share one MGET: all of them on a
// single server, those of one slot on a Cluster.
func (r *Reconciler) groupKey(t projection.Target) string {
	if _, single := r.target.Client.(*redis.Client); single {
		return ""
	}
	return strconv.Itoa(r.target.Keyspace.Slot(t))
}

func (r *Reconciler) fillValue(p *Projected, v any) error {
	switch v := v.(type) {
	case nil:
		return nil
	case string:
		p.HasValue = true
		if r.target.Kind != projection.KindSortedSet {
			p.Data = []byte(v)
			return nil
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return fmt.Errorf("%w: score %q", ErrUnexpectedReply, v)
		}
		p.Score = f
		return nil
	case float64: // RESP3 double
		p.HasValue = true
		p.Score = v
		return nil
	}
	return fmt.Errorf("%w: value of type %T", ErrUnexpectedReply, v)
}

func fillVersion(p *Projected, v any) error {
	switch v := v.(type) {
	case nil:
		return nil
	case string:
		p.parseVersion(v)
		return nil
	}
	return fmt.Errorf("%w: version of type %T", ErrUnexpectedReply, v)
}
