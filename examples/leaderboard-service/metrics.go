package main

import (
	"context"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"

	"github.com/verity-go/verity/reconcile"
)

// meterName is the instrumentation scope of the service's own instruments.
const meterName = "github.com/verity-go/verity/examples/leaderboard-service"

// metrics is the service's OpenTelemetry pipeline: a MeterProvider whose
// only reader is a Prometheus exporter on a registry of the service's own
// (no global state), served at /metrics together with the Go runtime and
// process collectors.
//
// Instruments (Prometheus names in brackets):
//
//	verity.service.http.requests        {request}  [verity_service_http_requests_total] route, code
//	verity.service.http.duration        s          [verity_service_http_duration_seconds] route
//	verity.service.submits              {command}  [verity_service_submits_total] outcome
//	verity.service.reconcile.runs       {run}      [verity_service_reconcile_runs_total] outcome
//	verity.service.reconcile.findings   {entity}   [verity_service_reconcile_findings_total] class
//	verity.service.reconcile.repaired   {entity}   [verity_service_reconcile_repaired_total]
//	verity.service.outbox.pending       {row}      [verity_service_outbox_pending]
//	verity.service.outbox.in_flight     {row}      [verity_service_outbox_in_flight]
//	verity.service.outbox.oldest_age    s          [verity_service_outbox_oldest_age_seconds]
//	verity.service.outbox.dead_letters  {row}      [verity_service_outbox_dead_letters]
//	verity.service.projection.lag       s          [verity_service_projection_lag_seconds]
//
// The library packages' own instruments (verity.leaderboard.*,
// verity.outbox.*, verity.projection.*) are on the same provider: NewService
// hands it to the board, whose worker inherits it.
type metrics struct {
	provider *sdkmetric.MeterProvider
	handler  http.Handler

	requests          metric.Int64Counter
	duration          metric.Float64Histogram
	submits           metric.Int64Counter
	reconcileRuns     metric.Int64Counter
	reconcileFindings metric.Int64Counter
	reconcileRepaired metric.Int64Counter
}

func newMetrics(s *Service) (*metrics, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(collectors.NewGoCollector()); err != nil {
		return nil, err
	}
	if err := reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, err
	}
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, err
	}
	res := resource.NewSchemaless(
		attribute.String("service.name", "leaderboard-service"),
		attribute.String("verity.board", s.board.Name()),
	)
	m := &metrics{
		provider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter), sdkmetric.WithResource(res)),
		handler:  promhttp.HandlerFor(reg, promhttp.HandlerOpts{}),
	}
	meter := m.provider.Meter(meterName)
	var errs []error
	add := func(err error) { errs = append(errs, err) }
	m.requests, err = meter.Int64Counter("verity.service.http.requests", metric.WithUnit("{request}"),
		metric.WithDescription("HTTP requests served, by route pattern and status code."))
	add(err)
	m.duration, err = meter.Float64Histogram("verity.service.http.duration", metric.WithUnit("s"),
		metric.WithDescription("HTTP request duration, by route pattern."),
		metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
	add(err)
	m.submits, err = meter.Int64Counter("verity.service.submits", metric.WithUnit("{command}"),
		metric.WithDescription("Score commands, by outcome: applied, duplicate, conflict, invalid, error."))
	add(err)
	m.reconcileRuns, err = meter.Int64Counter("verity.service.reconcile.runs", metric.WithUnit("{run}"),
		metric.WithDescription("Scheduled reconcile runs, by outcome: ok, error."))
	add(err)
	m.reconcileFindings, err = meter.Int64Counter("verity.service.reconcile.findings", metric.WithUnit("{entity}"),
		metric.WithDescription("Entities scheduled reconciles found not current, by class (missing, stale, ahead, corrupt, orphan)."))
	add(err)
	m.reconcileRepaired, err = meter.Int64Counter("verity.service.reconcile.repaired", metric.WithUnit("{entity}"),
		metric.WithDescription("Repairs written by scheduled reconciles."))
	add(err)

	pending, err := meter.Int64ObservableGauge("verity.service.outbox.pending", metric.WithUnit("{row}"),
		metric.WithDescription("Outbox rows not yet acknowledged (whole outbox)."))
	add(err)
	inFlight, err := meter.Int64ObservableGauge("verity.service.outbox.in_flight", metric.WithUnit("{row}"),
		metric.WithDescription("Outbox rows claimed under an unexpired lease."))
	add(err)
	oldest, err := meter.Float64ObservableGauge("verity.service.outbox.oldest_age", metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest pending outbox row; alert on it."))
	add(err)
	dead, err := meter.Int64ObservableGauge("verity.service.outbox.dead_letters", metric.WithUnit("{row}"),
		metric.WithDescription("Rows in the outbox's dead-letter table (every stream: all boards sharing the outbox)."))
	add(err)
	lag, err := meter.Float64ObservableGauge("verity.service.projection.lag", metric.WithUnit("s"),
		metric.WithDescription("The board's projection lag (Board.Freshness); absent while it cannot be measured."))
	add(err)
	for _, e := range errs {
		if e != nil {
			return nil, e
		}
	}
	_, err = meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		// Scrapes reuse the cached snapshot; a failed one, or one not read
		// within scrapeStatsWait, reports nothing rather than zeros that
		// would look healthy.
		ctx, cancel := context.WithTimeout(ctx, scrapeStatsWait)
		defer cancel()
		snap := s.snapshot(ctx)
		if snap.Err != nil {
			return nil
		}
		o.ObserveInt64(pending, snap.Outbox.Pending)
		o.ObserveInt64(inFlight, snap.Outbox.InFlight)
		o.ObserveFloat64(oldest, snap.Outbox.OldestPendingAge.Seconds())
		o.ObserveInt64(dead, snap.Outbox.DeadLetters)
		if snap.Freshness.Lag >= 0 { // negative: not measured; report nothing
			o.ObserveFloat64(lag, snap.Freshness.Lag.Seconds())
		}
		return nil
	}, pending, inFlight, oldest, dead, lag)
	if err != nil {
		return nil, err
	}
	// Every finding class starts at 0: a series born at its first finding
	// would show Prometheus's increase() no growth.
	for _, class := range reconcile.Classes {
		if class != reconcile.ClassCurrent {
			m.reconcileFindings.Add(context.Background(), 0, metric.WithAttributes(attribute.String("class", class.String())))
		}
	}
	return m, nil
}

func (m *metrics) shutdown(ctx context.Context) error { return m.provider.Shutdown(ctx) }

func (m *metrics) countSubmit(ctx context.Context, outcome string) {
	m.submits.Add(ctx, 1, metric.WithAttributes(attribute.String("outcome", outcome)))
}

func (m *metrics) recordReconcile(ctx context.Context, report *reconcile.Report, err error) {
	outcome := "ok"
	if err != nil {
		outcome = "error"
	}
	m.reconcileRuns.Add(ctx, 1, metric.WithAttributes(attribute.String("outcome", outcome)))
	if report == nil {
		return
	}
	for class, n := range report.Counts {
		if class == reconcile.ClassCurrent {
			continue // not a finding: alerts on any increase must stay quiet on healthy runs
		}
		m.reconcileFindings.Add(ctx, n, metric.WithAttributes(attribute.String("class", class.String())))
	}
	m.reconcileRepaired.Add(ctx, report.Repaired)
}

// instrument counts and times every request by its route pattern (never
// by raw path, which would give user ids their own time series).
func (m *metrics) instrument(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		next.ServeHTTP(rec, r)
		route := r.Pattern // set by ServeMux on the request it was given
		if route == "" {
			route = "unmatched"
		}
		ctx := context.WithoutCancel(r.Context())
		m.requests.Add(ctx, 1, metric.WithAttributes(attribute.String("route", route), attribute.Int("code", rec.status)))
		m.duration.Record(ctx, time.Since(start).Seconds(), metric.WithAttributes(attribute.String("route", route)))
	})
}

type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (r *statusRecorder) WriteHeader(code int) {
	r.status = code
	r.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (r *statusRecorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }
