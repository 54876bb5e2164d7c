package versioncache

import "sync/atomic"

// Stats are counters since the Cache was created. They are per process.
type Stats struct {
	// Hits and Misses count Get and GetAt calls, each once (a call whose
	// read of Redis failed before it missed is neither): a call that ran or
	// joined a load is a miss, even if it went round again after that load
	// was given up and was then served from Redis.
	Hits   uint64 // reads served from Redis
	Misses uint64 // reads that had to load (or join a load)
	Loads  uint64 // calls of a loader, including fail-open loads
	// SharedLoads are misses answered by another goroutine's load of the
	// same id and version (its value or its error) instead of loading. Not
	// counted: a joined load that the caller running it gave up, or that
	// found the version moved while waiting for another process's fill
	// (the miss then loads, or joins a load, again, and is counted by how
	// that is answered), nor a miss whose own ctx ended while it waited for
	// the load (it got its ctx's error: a miss, neither shared nor a load).
	SharedLoads uint64
	Fills       uint64 // values stored
	// StaleFillsSkipped are loads not stored because the version they were
	// loaded under was no longer the id's version at the fill: an
	// Invalidate moved it (a stale-set race that versioning closed), or
	// the version key was evicted or flushed, or expired before a fill that
	// came more than TTL + FillLeaseTTL after its miss (see Config.TTL).
	// For GetAt, loads not stored because a newer version was stored.
	StaleFillsSkipped uint64
	Invalidations     uint64 // Invalidate calls that succeeded
	// OrphanedValueKeys is always 0. Values used to be stored per version,
	// so each Invalidate left the previous one behind until its TTL; now
	// Invalidate deletes the current value in the same script that moves the
	// version, and a refused fill stores nothing, so no value key is ever
	// orphaned.
	//
	// Deprecated: kept (with its metric) so that existing dashboards and
	// alerts keep working; it no longer counts anything.
	OrphanedValueKeys uint64
	// LeaseWaits are misses that found another process filling and waited
	// for its value, however the wait ended: with its value
	// (LeaseWaitHits), FillLeaseWait running out (LeaseFallbacks), or
	// otherwise, in neither of those: the version moved, the lease passed
	// to this process, the value filled did not decode, a poll of Redis
	// failed, or the caller's ctx ended.
	LeaseWaits     uint64
	LeaseWaitHits  uint64 // ... and got its value while waiting
	LeaseFallbacks uint64 // ... and loaded themselves after FillLeaseWait
	// RedisErrors are failed Redis calls, not those cut off by the
	// caller's ctx; an Invalidate or Peek that retried TRYAGAIN during a
	// slot migration until its ctx ended counts once. A call that fails
	// after the caller's ctx ended counts as cut off, even when Redis had
	// stopped answering: without ContextTimeoutEnabled, go-redis waits for
	// a hung Redis until its ReadTimeout (5 s by default), and callers
	// whose deadlines are shorter never see it counted here. Alert on
	// Redis itself, or on the callers' timeouts, for a hang.
	RedisErrors  uint64
	DecodeErrors uint64 // cached values the Codec could not decode
	// ReplicationErrors are Invalidate calls that returned a
	// *ReplicationError: the bump happened on the primary, but fewer
	// replicas than Config.InvalidateReplicas confirmed it in time. They
	// are not counted in Invalidations.
	ReplicationErrors uint64
	// FailOpenLoads are loads run because Redis failed (FailOpen), to serve
	// the loader's value uncached; like Loads, they count a load that then
	// failed (or whose value did not encode) too. They are included in
	// Loads.
	FailOpenLoads uint64
}

type counters struct {
	hits, misses, loads, sharedLoads, fills, staleFillsSkipped atomic.Uint64
	invalidations                                              atomic.Uint64
	leaseWaits, leaseWaitHits, leaseFallbacks                  atomic.Uint64
	redisErrors, decodeErrors, failOpenLoads                   atomic.Uint64
	replicationErrors                                          atomic.Uint64
}

// Stats returns a snapshot of the counters (all zero for a nil *Cache).
//
// The counters are read one at a time while other goroutines count, so a
// snapshot is not of one instant; but a count that is part of another
// (FailOpenLoads of Loads, SharedLoads of Misses, LeaseWaitHits and
// LeaseFallbacks of LeaseWaits, Fills and StaleFillsSkipped of Loads) is
// never above it: a part is counted after its whole and read before it.
func (c *Cache[T]) Stats() Stats {
	if c == nil {
		return Stats{}
	}
	s := &c.stats
	var parts Stats
	parts.FailOpenLoads = s.failOpenLoads.Load()
	parts.SharedLoads = s.sharedLoads.Load()
	parts.LeaseWaitHits = s.leaseWaitHits.Load()
	parts.LeaseFallbacks = s.leaseFallbacks.Load()
	parts.Fills = s.fills.Load()
	parts.StaleFillsSkipped = s.staleFillsSkipped.Load()
	return Stats{
		Hits: s.hits.Load(), Misses: s.misses.Load(), Loads: s.loads.Load(),
		SharedLoads: parts.SharedLoads, Fills: parts.Fills,
		StaleFillsSkipped: parts.StaleFillsSkipped,
		Invalidations:     s.invalidations.Load(),
		LeaseWaits:        s.leaseWaits.Load(), LeaseWaitHits: parts.LeaseWaitHits,
		LeaseFallbacks: parts.LeaseFallbacks,
		RedisErrors:    s.redisErrors.Load(), DecodeErrors: s.decodeErrors.Load(),
		FailOpenLoads: parts.FailOpenLoads, ReplicationErrors: s.replicationErrors.Load(),
	}
}
