package reconcile

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/keyenc"
	"github.com/verity-go/verity/projection"
)

// scanOrphans looks for projection entries the source does not have. It
// walks the projection with cursor scans, PageSize entries at a time, and
// looks each batch up in the source:
//
//   - entries with a version: HSCAN of the version hash (documents: SCAN of
//     the version keys);
//   - entries with a value but no version: ZSCAN/HSCAN of the value key
//     (documents: SCAN of the value keys), keeping only those whose version
//     is absent, so no entry is counted twice.
//
// SCAN visits every key of every master, not only the projection's, so the
// document scan costs time proportional to the whole database; on a large
// shared database prefer Config.SkipOrphans for frequent runs.
//
// SCAN-family cursors guarantee every entry present for the whole scan is
// returned at least once; an entry may be returned twice while Redis
// rehashes, and would then be counted twice.
func (r *Reconciler) scanOrphans(ctx context.Context, opts RunOptions, rep *Report) error {
	if r.target.Kind == projection.KindDocument {
		if err := r.scanDocuments(ctx, ":dv", func(ids []string) error {
			return r.checkCandidates(ctx, opts, ids, false, rep)
		}); err != nil {
			return err
		}
		return r.scanDocuments(ctx, ":d", func(ids []string) error {
			return r.checkCandidates(ctx, opts, ids, true, rep)
		})
	}
	if err := r.scanVersions(ctx, func(members []string) error {
		return r.checkCandidates(ctx, opts, members, false, rep)
	}); err != nil {
		return err
	}
	valueScan := "HSCAN"
	if r.target.Kind == projection.KindSortedSet {
		valueScan = "ZSCAN"
	}
	return r.scanCollection(ctx, valueScan, r.valueKey, func(members []string) error {
		return r.checkCandidates(ctx, opts, members, true, rep)
	})
}

// noOrphans reports whether a collection provably has no orphans after a
// full pass: if the version hash and the value key hold exactly as many
// entries as the pass found (or wrote) for source rows, every entry belongs
// to a source row and the scan can be skipped. This is the common case and
// turns the scan into one round trip. An entry that vanishes from Redis
// during the pass while an orphan exists can hide that orphan for this run;
// the next run, which sees the vanished entry as missing, finds it.
// Documents have no cheap count; they are always scanned.
func (r *Reconciler) noOrphans(ctx context.Context, rep *Report) (bool, error) {
	if r.target.Kind == projection.KindDocument || rep.tally.unknown {
		return false, nil
	}
	pipe, err := r.collectionPipeline(ctx)
	if err != nil {
		return false, err
	}
	versions := make([]*redis.IntCmd, len(r.versionKeys))
	for i, k := range r.versionKeys {
		versions[i] = pipe.HLen(ctx, k)
	}
	var values *redis.IntCmd
	if r.target.Kind == projection.KindSortedSet {
		values = pipe.ZCard(ctx, r.valueKey)
	} else {
		values = pipe.HLen(ctx, r.valueKey)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return false, fmt.Errorf("reconcile: counting projection entries: %w", err)
	}
	var total int64
	for _, c := range versions {
		total += c.Val()
	}
	return total == rep.tally.versions && values.Val() == rep.tally.values, nil
}

// checkCandidates classifies projection entries found by a scan: those the
// source lacks are orphans. versionless restricts the check to entries
// without a version (the value-key scan).
//
// An orphan's compare-and-set removal insists on a projection state read
// before the source lookup that confirmed the key absent. Read after it,
// the state could hold an entry created and projected in between: the
// lookup missed it, and the removal would delete a legitimate entry. Read
// before, such a create changes the projection after the read, so the
// removal declines (ResultRaced); a create projected before the read was
// committed before it too, so the lookup finds it.
//
// Most scanned entries belong to source rows, so the version scan looks
// the batch up first and reads the projection only for the keys the
// source lacks, then looks those up again to confirm: only keys still
// absent are orphans. The value scan reads first anyway, to keep only
// entries without a version (few), so that read serves and one lookup
// confirms.
func (r *Reconciler) checkCandidates(ctx context.Context, opts RunOptions, keys []string, versionless bool, rep *Report) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	keys = dedupe(keys)
	if !versionless {
		rep.Scanned += int64(len(keys))
		var (
			err   error
			found []Row
		)
		if keys, found, err = r.absentFromSource(ctx, keys); err != nil {
			return err
		}
		if err := r.checkFound(ctx, opts, found, rep); err != nil || len(keys) == 0 {
			return err
		}
	}
	projected, err := r.read(ctx, keys)
	if err != nil {
		return err
	}
	// Each scan keeps its own entries, so that no entry is counted
	// twice: the value scan those without a version, the version scan
	// those with one (a document's version key holding another type reads
	// as no version, and its value key is met by the value scan).
	kept, keptRead := keys[:0], projected[:0]
	for i, k := range keys {
		if projected[i].HasVersion != versionless {
			kept = append(kept, k)
			keptRead = append(keptRead, projected[i])
		}
	}
	keys, projected = kept, keptRead
	if versionless {
		rep.Scanned += int64(len(keys))
	}
	if len(keys) == 0 {
		return nil
	}
	absent, found, err := r.absentFromSource(ctx, keys)
	if err != nil {
		return err
	}
	if err := r.checkFound(ctx, opts, found, rep); err != nil {
		return err
	}
	absentRead := make([]Projected, 0, len(absent))
	for i, j := 0, 0; i < len(keys) && j < len(absent); i++ {
		if keys[i] == absent[j] { // absent is a subsequence of keys
			absentRead = append(absentRead, projected[i])
			j++
		}
	}
	return r.checkAbsent(ctx, opts, absent, absentRead, rep)
}

// absentFromSource returns the keys, in order, that the source does not
// have, and the rows it has for the others.
func (r *Reconciler) absentFromSource(ctx context.Context, keys []string) ([]string, []Row, error) {
	rows, err := r.source.Lookup(ctx, keys)
	if err != nil {
		return nil, nil, wrap("looking up projection entries in the source", err)
	}
	found, absent := rowsAsked(keys, rows)
	return absent, found, nil
}

// rowsAsked returns the rows of a Lookup of keys that answer them, one a
// key (rows for other keys, or repeated, break the Lookup contract and are
// left out), and the keys, in order, that no row answers.
func rowsAsked(keys []string, rows []Row) (found []Row, absent []string) {
	unanswered := make(map[string]struct{}, len(keys))
	for _, k := range keys {
		unanswered[k] = struct{}{}
	}
	for _, row := range rows {
		if _, ok := unanswered[row.Key]; ok {
			delete(unanswered, row.Key)
			found = append(found, row)
		}
	}
	for _, k := range keys {
		if _, ok := unanswered[k]; ok {
			absent = append(absent, k)
		}
	}
	return found, absent
}

// checkFound checks the scanned entries the source has against their rows,
// read from the projection after the lookup, and settles those Redis holds
// ahead of the row or with another value at its version: an entity
// created again after the walk passed it (after PostgreSQL went back, at a
// version Redis still holds) had its delivery refused, and nothing else
// would correct it. Entries current, or behind the row (a delivery in
// flight), are left to the walk and the outbox, as are those the recheck
// finds so, or finds changed (writes landed between the lookup and the
// reads, as on any entry while users score): the walk counted their rows.
// The finds it settles are counted in Counts, not in Checked (below): a
// Checked above what Redis holds a leaderboard Verify takes for lost
// members.
func (r *Reconciler) checkFound(ctx context.Context, opts RunOptions, found []Row, rep *Report) error {
	if len(found) == 0 {
		return nil
	}
	projected, err := r.readRows(ctx, found)
	if err != nil {
		return err
	}
	var rows []Row
	var read []Projected
	for i := range found {
		if _, seen := rep.drifted[found[i].Key]; seen {
			continue
		}
		// Ahead, or another value at the row's version: what a delivery
		// refused against a lost version leaves. (A value or version
		// missing is a loss, which the walk's findings cover.)
		c := Classify(r.target.Kind, &found[i], projected[i])
		if c == ClassAhead || c == ClassCorrupt && projected[i].HasValue && projected[i].HasVersion {
			if err := r.validateRow(&found[i]); err != nil {
				return err
			}
			rows = append(rows, found[i])
			read = append(read, projected[i])
		}
	}
	if len(rows) == 0 {
		return nil
	}
	findings, _, err := r.classifyRead(ctx, rows, read)
	if err != nil {
		return err
	}
	firstRead := make(map[string]Projected, len(rows))
	for i := range rows {
		firstRead[rows[i].Key] = read[i]
	}
	kept, examined := findings[:0], 0
	for _, f := range findings {
		if !sameProjected(firstRead[f.Key], f.Projected) {
			// Torn reads through the recheck, each looking corrupt or
			// ahead: writes landed, as on one found current. A lost
			// entity created again keeps its state: its deliveries
			// are refused.
			continue
		}
		switch f.Class {
		case ClassAhead, ClassCorrupt:
			examined++
			kept = append(kept, f)
		case ClassOrphan:
			kept = append(kept, f) // its row deleted since
		}
	}
	// Examined, not Checked: the scan cannot tell an entity the walk did
	// not meet from a row the walk counted that a foreign write (a hand
	// edit, a buggy writer) changed after it passed, and counted twice
	// such a row would make Checked exceed what Redis holds.
	rep.examined += int64(examined)
	return r.settleFindings(ctx, opts, kept, 0, rep)
}

// checkAbsent classifies keys the source does not have against what the
// projection held for them, read before the lookup that confirmed their
// absence (see checkCandidates): any projection entry for them is an
// orphan, unless this run has already counted it as one.
func (r *Reconciler) checkAbsent(ctx context.Context, opts RunOptions, missing []string, projected []Projected, rep *Report) error {
	var findings []Finding
	for i, k := range missing {
		if rep.countedOrphan(k) {
			continue
		}
		if c := Classify(r.target.Kind, nil, projected[i]); c == ClassOrphan {
			findings = append(findings, Finding{Class: c, Key: k, Projected: projected[i]})
		}
	}
	rep.examined += int64(len(missing))
	return r.settle(ctx, opts, findings, rep)
}

// scanVersions hands fn every member with a version, in batches of about
// PageSize. Without buckets it is an HSCAN of the version hash. With
// buckets it sends HSCAN 0 for PageSize/64 buckets at a time (about
// PageSize entries at the documented 64 per bucket), pipelined: a listpack
// bucket answers whole with cursor 0, and the few that answer with another
// cursor (hashtable buckets) are scanned on. Batches of at most PageSize
// members go to fn.
func (r *Reconciler) scanVersions(ctx context.Context, fn func([]string) error) error {
	if r.buckets == 0 {
		return r.scanCollection(ctx, "HSCAN", r.versionKeys[0], fn)
	}
	return prefetched(ctx, fn, func(ctx context.Context, emit func([]string) error) error {
		per := max(1, r.cfg.PageSize/64)
		for lo := 0; lo < len(r.versionKeys); lo += per {
			keys := r.versionKeys[lo:min(lo+per, len(r.versionKeys))]
			// One node for the batch and the scans it continues.
			pipeline, err := r.collectionPipelines(ctx)
			if err != nil {
				return err
			}
			pipe := pipeline()
			cmds := make([]*redis.ScanCmd, len(keys))
			for i, k := range keys {
				cmds[i] = pipe.HScan(ctx, k, 0, "", int64(r.cfg.PageSize))
			}
			if _, err := pipe.Exec(ctx); err != nil {
				return fmt.Errorf("reconcile: HSCAN of version buckets: %w", err)
			}
			var members []string
			for i, c := range cmds {
				pairs, cursor := c.Val()
				for j := 0; j+1 < len(pairs); j += 2 {
					members = append(members, pairs[j])
				}
				if cursor != 0 {
					if err := r.scanCollectionFrom(ctx, pipeline, "HSCAN", keys[i], cursor, emit); err != nil {
						return err
					}
				}
			}
			for len(members) > 0 {
				n := min(len(members), r.cfg.PageSize)
				if err := emit(members[:n]); err != nil {
					return err
				}
				members = members[n:]
			}
		}
		return nil
	})
}

// scanCollection runs HSCAN or ZSCAN over key and hands each batch of
// members (fields) to fn.
func (r *Reconciler) scanCollection(ctx context.Context, cmd, key string, fn func([]string) error) error {
	return prefetched(ctx, fn, func(ctx context.Context, emit func([]string) error) error {
		return r.scanCollectionInto(ctx, cmd, key, emit)
	})
}

func (r *Reconciler) scanCollectionInto(ctx context.Context, cmd, key string, fn func([]string) error) error {
	pipeline, err := r.collectionPipelines(ctx)
	if err != nil {
		return fmt.Errorf("reconcile: %s %s: %w", cmd, key, err)
	}
	return r.scanCollectionFrom(ctx, pipeline, cmd, key, 0, fn)
}

// scanCollectionFrom continues a scan of key at cursor (0 starts one), with
// pipelines on the node the cursor belongs to.
func (r *Reconciler) scanCollectionFrom(ctx context.Context, pipeline func() redis.Pipeliner, cmd, key string, cursor uint64, fn func([]string) error) error {
	for {
		pipe := pipeline()
		var scan *redis.ScanCmd
		if cmd == "ZSCAN" {
			scan = pipe.ZScan(ctx, key, cursor, "", int64(r.cfg.PageSize))
		} else {
			scan = pipe.HScan(ctx, key, cursor, "", int64(r.cfg.PageSize))
		}
		var pairs []string
		_, err := pipe.Exec(ctx)
		if err == nil {
			pairs, cursor, err = scan.Result()
		}
		if err != nil {
			return fmt.Errorf("reconcile: %s %s: %w", cmd, key, err)
		}
		members := make([]string, 0, len(pairs)/2)
		for i := 0; i+1 < len(pairs); i += 2 {
			members = append(members, pairs[i])
		}
		if err := r.inPages(members, fn); err != nil {
			return err
		}
		if cursor == 0 {
			return nil
		}
	}
}

// inPages hands keys to fn in batches of at most PageSize: a SCAN-family
// reply can hold more (a listpack answers whole, MATCH filters a COUNT of
// 10 pages), and each batch is one lookup, one read and one repair call.
func (r *Reconciler) inPages(keys []string, fn func([]string) error) error {
	for len(keys) > 0 {
		n := min(len(keys), r.cfg.PageSize)
		if err := fn(keys[:n]); err != nil {
			return err
		}
		keys = keys[n:]
	}
	return nil
}

// scanDocuments SCANs every master for the keys of the target's documents
// (those whose id starts with Target.Namespace) ending in suffix and hands
// each batch of their source keys (the ids without the namespace) to fn.
func (r *Reconciler) scanDocuments(ctx context.Context, suffix string, fn func([]string) error) error {
	return prefetched(ctx, fn, func(ctx context.Context, emit func([]string) error) error {
		return r.scanDocumentsInto(ctx, suffix, emit)
	})
}

// scansDocuments reports whether scanDocuments can reach every key through
// client: SCAN on a *redis.Client (one server, or the master a Sentinel
// client follows) or on every master of a *redis.ClusterClient. A Ring is
// not scanned: which shard holds a key depends on the shards it counts up.
func scansDocuments(client redis.UniversalClient) bool {
	switch client.(type) {
	case *redis.Client, *redis.ClusterClient:
		return true
	}
	return false
}

func (r *Reconciler) scanDocumentsInto(ctx context.Context, suffix string, fn func([]string) error) error {
	prefix, namespace := r.target.Keyspace.Prefix(), r.target.Namespace
	// Escape works byte by byte, so an escaped id starts with the escaped
	// namespace: MATCH leaves out other streams' documents on the server.
	pattern := escapeGlob(prefix) + "{" + escapeGlob(keyenc.Escape(namespace)) + "*}" + suffix
	scanNode := func(ctx context.Context, node *redis.Client) error {
		var cursor uint64
		for {
			// MATCH filters after the fact, so a larger COUNT costs no
			// memory but saves round trips over unrelated keys.
			keys, next, err := node.Scan(ctx, cursor, pattern, int64(10*r.cfg.PageSize)).Result()
			if err != nil {
				return fmt.Errorf("reconcile: SCAN %s: %w", pattern, err)
			}
			ids := make([]string, 0, len(keys))
			for _, k := range keys {
				if id, ok := documentID(k, prefix, suffix); ok && strings.HasPrefix(id, namespace) {
					ids = append(ids, id[len(namespace):])
				}
			}
			if err := r.inPages(ids, fn); err != nil {
				return err
			}
			if cursor = next; cursor == 0 {
				return nil
			}
		}
	}
	switch c := r.target.Client.(type) {
	case *redis.Client:
		return scanNode(ctx, c)
	case *redis.ClusterClient:
		// ForEachMaster calls back concurrently; collect the masters and
		// scan them one after the other, so batches reach fn in order.
		var (
			mu      sync.Mutex
			masters []*redis.Client
		)
		if err := c.ForEachMaster(ctx, func(_ context.Context, node *redis.Client) error {
			mu.Lock()
			defer mu.Unlock()
			masters = append(masters, node)
			return nil
		}); err != nil {
			return fmt.Errorf("reconcile: listing cluster masters: %w", err)
		}
		for _, m := range masters {
			if err := scanNode(ctx, m); err != nil {
				return err
			}
		}
		return nil
	}
	return &ConfigError{Field: "Target.Client", Reason: fmt.Sprintf("orphan scan of documents needs a *redis.Client or *redis.ClusterClient, not %T; set Config.SkipOrphans", r.target.Client)}
}

// prefetched runs produce in a goroutine that emits batches one ahead of
// consume, so the next Redis scan overlaps the current batch's source
// lookup. It returns the first error of either side and always waits for
// the goroutine.
func prefetched(ctx context.Context, consume func([]string) error, produce func(ctx context.Context, emit func([]string) error) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	batches := make(chan []string, 1)
	produced := make(chan error, 1)
	go func() {
		defer close(batches)
		produced <- produce(ctx, func(keys []string) error {
			// Checked first: once the consumer drains after a failure, a
			// select would pick at random between a free slot and Done.
			if err := ctx.Err(); err != nil {
				return err
			}
			select {
			case batches <- keys:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})
	}()
	var err error
	for keys := range batches {
		if err == nil {
			if err = consume(keys); err != nil {
				cancel() // stop producing; keep draining until it exits
			}
		}
	}
	if perr := <-produced; err == nil {
		err = perr
	}
	return err
}

// documentID extracts and unescapes the document id from a key
// prefix{escaped-id}suffix.
func documentID(key, prefix, suffix string) (string, bool) {
	if !strings.HasPrefix(key, prefix+"{") || !strings.HasSuffix(key, "}"+suffix) {
		return "", false
	}
	tag := key[len(prefix)+1 : len(key)-len(suffix)-1]
	if tag == "" {
		// Another application's key: Escape writes the empty id as "%".
		return "", false
	}
	if tag == "%" {
		return "", true
	}
	id, err := keyenc.Unescape(tag)
	if err != nil || strings.ContainsAny(tag, "{}") {
		return "", false
	}
	return id, true
}

// escapeGlob escapes the characters SCAN MATCH treats specially.
func escapeGlob(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '*', '?', '[', ']', '\\':
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func dedupe(keys []string) []string {
	seen := make(map[string]struct{}, len(keys))
	out := keys[:0]
	for _, k := range keys {
		if _, ok := seen[k]; !ok {
			seen[k] = struct{}{}
			out = append(out, k)
		}
	}
	return out
}
