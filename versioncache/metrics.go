package versioncache

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/telemetry"
)

// Attributes of the package's instruments. The prefix is one per cached
// type (Config.Prefix), so it is bounded; ids are never attributes.
const (
	AttributePrefix = "verity.cache.prefix"
	AttributeResult = "verity.cache.result" // hit, miss; hit, fallback for lease waits
	AttributeShared = "verity.cache.shared" // whether a load was joined instead of run
	AttributeReason = "verity.cache.reason" // lease_timeout, redis_error
	AttributeKind   = "verity.cache.kind"   // redis, decode, replication
)

// Instrument names of the package.
const (
	metricReads         = "verity.cache.reads"
	metricLoads         = "verity.cache.loads"
	metricFills         = "verity.cache.fills"
	metricStaleSkipped  = "verity.cache.stale_fills_skipped"
	metricFallbacks     = "verity.cache.fallbacks"
	metricLeaseWaits    = "verity.cache.lease_waits"
	metricInvalidations = "verity.cache.invalidations"
	metricOrphans       = "verity.cache.orphaned_values"
	metricErrors        = "verity.cache.errors"
	metricLoadDuration  = "verity.cache.load.duration"
)

// cacheMetrics exports a Cache's Stats counters as observable counters, read
// in one callback at collection time, so the hit path pays nothing for
// metrics. Only the load duration is recorded synchronously (a load is slow
// anyway). A nil *cacheMetrics records nothing.
type cacheMetrics struct {
	loadDuration metric.Float64Histogram
	prefix       metric.MeasurementOption

	callback *telemetry.Once // the observable instruments' callback
}

func newCacheMetrics(cfg *Config, stats func() Stats) (*cacheMetrics, error) {
	if !telemetry.Enabled(cfg.MeterProvider) {
		return nil, nil
	}
	in := telemetry.New(cfg.MeterProvider, "versioncache")
	prefix := attribute.String(AttributePrefix, cfg.Prefix)
	with := func(kv ...attribute.KeyValue) metric.ObserveOption {
		return metric.WithAttributeSet(attribute.NewSet(append([]attribute.KeyValue{prefix}, kv...)...))
	}
	var (
		reads = in.Int64ObservableCounter(metricReads, "{read}",
			"Get and GetAt calls by result: hit (served from Redis) or miss (loaded, or joined a load). A call whose first Redis read failed is neither (errors and fallbacks count it); a miss stays one when a later Redis call fails.")
		loads = in.Int64ObservableCounter(metricLoads, "{load}",
			"Loader calls (shared=false: Stats.Loads, including fail-open loads) and misses answered by another caller's load of the same id and version (shared=true: Stats.SharedLoads). A miss whose own context ended while it waited for another's load is in neither.")
		fills = in.Int64ObservableCounter(metricFills, "{value}",
			"Loaded values stored in Redis.")
		staleSkipped = in.Int64ObservableCounter(metricStaleSkipped, "{value}",
			"Loaded values not stored because the version moved while loading (a stale-set race closed) or its key expired or was lost first, or, for GetAt, because a newer version was stored.")
		fallbacks = in.Int64ObservableCounter(metricFallbacks, "{read}",
			"Reads that loaded without the cache's protection, by reason: lease_timeout (the filling process did not deliver within FillLeaseWait), redis_error (FailOpen ran the loader, to serve its value uncached).")
		leaseWaits = in.Int64ObservableCounter(metricLeaseWaits, "{read}",
			"Misses that waited for another process's fill and got its value (result=hit: Stats.LeaseWaitHits) or loaded themselves after FillLeaseWait ran out (result=fallback: Stats.LeaseFallbacks, also counted as fallbacks with reason lease_timeout). Waits that ended otherwise (the version moved, the lease passed to this process, the value did not decode, a poll failed, the caller's context ended) are not counted; Stats.LeaseWaits counts every wait.")
		invalidations = in.Int64ObservableCounter(metricInvalidations, "{call}",
			"Successful Invalidate calls.")
		orphans = in.Int64ObservableCounter(metricOrphans, "{key}",
			"Always 0: Invalidate deletes the current value instead of orphaning it (kept for existing dashboards).")
		errs = in.Int64ObservableCounter(metricErrors, "{error}",
			"Errors by kind: redis (a failed Redis call; an Invalidate or Peek that retried through a slot migration until its context ended counts once), decode (a cached value the Codec could not decode) or replication (an Invalidate that fewer replicas than InvalidateReplicas confirmed; not counted as an invalidation).")
	)
	m := &cacheMetrics{
		loadDuration: in.Histogram(metricLoadDuration, "s", "Duration of loader calls.", telemetry.DurationBuckets()...),
		prefix:       metric.WithAttributeSet(attribute.NewSet(prefix)),
	}
	if err := in.Err(); err != nil {
		return nil, err
	}
	var (
		hit, miss         = with(attribute.String(AttributeResult, "hit")), with(attribute.String(AttributeResult, "miss"))
		waitHit, waitFall = hit, with(attribute.String(AttributeResult, "fallback"))
		ran, joined       = with(attribute.Bool(AttributeShared, false)), with(attribute.Bool(AttributeShared, true))
		leaseTimeout      = with(attribute.String(AttributeReason, "lease_timeout"))
		redisError        = with(attribute.String(AttributeReason, "redis_error"))
		kindRedis         = with(attribute.String(AttributeKind, "redis"))
		kindDecode        = with(attribute.String(AttributeKind, "decode"))
		kindReplication   = with(attribute.String(AttributeKind, "replication"))
		plain             = with()
	)
	reg, err := in.Meter().RegisterCallback(func(_ context.Context, o metric.Observer) error {
		s := stats()
		o.ObserveInt64(reads, int64(s.Hits), hit)
		o.ObserveInt64(reads, int64(s.Misses), miss)
		o.ObserveInt64(loads, int64(s.Loads), ran)
		o.ObserveInt64(loads, int64(s.SharedLoads), joined)
		o.ObserveInt64(fills, int64(s.Fills), plain)
		o.ObserveInt64(staleSkipped, int64(s.StaleFillsSkipped), plain)
		o.ObserveInt64(fallbacks, int64(s.LeaseFallbacks), leaseTimeout)
		o.ObserveInt64(fallbacks, int64(s.FailOpenLoads), redisError)
		o.ObserveInt64(leaseWaits, int64(s.LeaseWaitHits), waitHit)
		o.ObserveInt64(leaseWaits, int64(s.LeaseFallbacks), waitFall)
		o.ObserveInt64(invalidations, int64(s.Invalidations), plain)
		o.ObserveInt64(orphans, int64(s.OrphanedValueKeys), plain)
		o.ObserveInt64(errs, int64(s.RedisErrors), kindRedis)
		o.ObserveInt64(errs, int64(s.DecodeErrors), kindDecode)
		o.ObserveInt64(errs, int64(s.ReplicationErrors), kindReplication)
		return nil
	}, reads, loads, fills, staleSkipped, fallbacks, leaseWaits, invalidations, orphans, errs)
	if err != nil {
		return nil, err
	}
	m.callback = telemetry.NewOnce(reg)
	return m, nil
}

// loaded records one loader call's duration.
func (m *cacheMetrics) loaded(ctx context.Context, start time.Time) {
	if m == nil {
		return
	}
	m.loadDuration.Record(ctx, time.Since(start).Seconds(), m.prefix)
}

func (m *cacheMetrics) close() error {
	if m == nil {
		return nil
	}
	if err := m.callback.Unregister(); err != nil {
		return errors.Join(errors.New("versioncache: unregistering metrics"), err)
	}
	return nil
}
