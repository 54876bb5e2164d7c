package telemetry

import (
	"errors"
	"fmt"
	"sync"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/verity-go/verity/internal/deps"
)

// ModulePath prefixes every meter name: a package's meter is named by its
// import path, as OpenTelemetry recommends for instrumentation libraries.
const ModulePath = "github.com/verity-go/verity"

// Meter returns the meter of package pkg (for example "outbox") from mp, or
// a no-op meter when mp is nil, a typed nil included (a
// *sdkmetric.MeterProvider left nil to turn metrics off).
func Meter(mp metric.MeterProvider, pkg string) metric.Meter {
	if deps.Missing(mp) {
		mp = noop.NewMeterProvider()
	}
	return mp.Meter(ModulePath + "/" + pkg)
}

// Enabled reports whether mp records anything, so callers can skip work
// (building attributes, reading clocks) that only metrics need.
func Enabled(mp metric.MeterProvider) bool {
	if deps.Missing(mp) {
		return false
	}
	_, isNoop := mp.(noop.MeterProvider)
	return !isNoop
}

// Instruments creates instruments on one meter and remembers every error,
// so a constructor can create all of its instruments and check once.
// An instrument that fails to be created is replaced by a no-op one, so the
// returned values are always usable.
type Instruments struct {
	meter metric.Meter
	errs  []error
}

// New returns an Instruments for package pkg's meter from mp (nil: no-op).
func New(mp metric.MeterProvider, pkg string) *Instruments {
	return &Instruments{meter: Meter(mp, pkg)}
}

// Meter returns the underlying meter, for callback registration.
func (in *Instruments) Meter() metric.Meter { return in.meter }

func (in *Instruments) fail(name string, err error) {
	in.errs = append(in.errs, fmt.Errorf("instrument %s: %w", name, err))
}

// Counter creates an Int64Counter.
func (in *Instruments) Counter(name, unit, description string) metric.Int64Counter {
	c, err := in.meter.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(description))
	if err != nil || c == nil {
		in.fail(name, errOrNil(err))
		return noop.Int64Counter{}
	}
	return c
}

// Histogram creates a Float64Histogram with explicit bucket boundaries.
func (in *Instruments) Histogram(name, unit, description string, buckets ...float64) metric.Float64Histogram {
	opts := []metric.Float64HistogramOption{metric.WithUnit(unit), metric.WithDescription(description)}
	if len(buckets) > 0 {
		opts = append(opts, metric.WithExplicitBucketBoundaries(buckets...))
	}
	h, err := in.meter.Float64Histogram(name, opts...)
	if err != nil || h == nil {
		in.fail(name, errOrNil(err))
		return noop.Float64Histogram{}
	}
	return h
}

// Int64ObservableGauge creates an Int64ObservableGauge (observed in a
// callback registered with the meter).
func (in *Instruments) Int64ObservableGauge(name, unit, description string) metric.Int64ObservableGauge {
	g, err := in.meter.Int64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(description))
	if err != nil || g == nil {
		in.fail(name, errOrNil(err))
		return noop.Int64ObservableGauge{}
	}
	return g
}

// Float64ObservableGauge creates a Float64ObservableGauge.
func (in *Instruments) Float64ObservableGauge(name, unit, description string) metric.Float64ObservableGauge {
	g, err := in.meter.Float64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(description))
	if err != nil || g == nil {
		in.fail(name, errOrNil(err))
		return noop.Float64ObservableGauge{}
	}
	return g
}

// Int64ObservableCounter creates an Int64ObservableCounter (a monotonic sum
// observed in a callback).
func (in *Instruments) Int64ObservableCounter(name, unit, description string) metric.Int64ObservableCounter {
	c, err := in.meter.Int64ObservableCounter(name, metric.WithUnit(unit), metric.WithDescription(description))
	if err != nil || c == nil {
		in.fail(name, errOrNil(err))
		return noop.Int64ObservableCounter{}
	}
	return c
}

// Err returns the instrument creation errors joined, or nil.
func (in *Instruments) Err() error {
	if len(in.errs) == 0 {
		return nil
	}
	return fmt.Errorf("metrics: %w", errors.Join(in.errs...))
}

func errOrNil(err error) error {
	if err == nil {
		return errors.New("the meter returned no instrument")
	}
	return err
}

// LagBuckets returns the bucket boundaries (seconds) of commit→visible lag
// histograms: from a few milliseconds (a healthy relay) to minutes (an
// outage).
func LagBuckets() []float64 {
	return []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300}
}

// DurationBuckets returns the bucket boundaries (seconds) of operation
// duration histograms (a handler call, a load, a reconcile run).
func DurationBuckets() []float64 {
	return []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300}
}

// Once holds a callback's registration until it is unregistered, at most
// once however often Unregister is called (a Close called twice, or
// concurrently). The zero value holds nothing.
type Once struct {
	mu  sync.Mutex
	reg metric.Registration
}

// NewOnce returns a Once holding reg.
func NewOnce(reg metric.Registration) *Once { return &Once{reg: reg} }

// Unregister unregisters the callback the first time and does nothing after.
func (o *Once) Unregister() error {
	if o == nil {
		return nil
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.reg == nil {
		return nil
	}
	err := o.reg.Unregister()
	o.reg = nil
	return err
}
