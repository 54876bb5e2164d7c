// Package metrictest collects the metrics a test recorded through an
// OpenTelemetry SDK MeterProvider backed by a ManualReader, and looks values
// up by instrument name and attributes. It is for tests only.
package metrictest

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Recorder is a MeterProvider whose metrics are read on demand.
type Recorder struct {
	// Provider is the MeterProvider to hand to the code under test.
	Provider *sdkmetric.MeterProvider
	reader   *sdkmetric.ManualReader
}

// New returns a Recorder that shuts its provider down when the test ends.
func New(t testing.TB) *Recorder {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return &Recorder{Provider: mp, reader: reader}
}

// Snapshot is one collection of every instrument.
type Snapshot struct {
	rm metricdata.ResourceMetrics
}

// Collect reads the current values (running observable callbacks).
func (r *Recorder) Collect(t testing.TB) Snapshot {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatalf("metrictest: collect: %v", err)
	}
	return Snapshot{rm: rm}
}

func (s Snapshot) find(name string) (metricdata.Metrics, bool) {
	for _, sm := range s.rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m, true
			}
		}
	}
	return metricdata.Metrics{}, false
}

// Has reports whether any instrument named name recorded something.
func (s Snapshot) Has(name string) bool {
	_, ok := s.find(name)
	return ok
}

// Scope returns the name of the meter that created instrument name (""
// when absent).
func (s Snapshot) Scope(name string) string {
	for _, sm := range s.rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				return sm.Scope.Name
			}
		}
	}
	return ""
}

// Bounds returns the bucket boundaries of the float64 histogram name, from
// its first data point (nil when it has none).
func (s Snapshot) Bounds(name string) []float64 {
	m, _ := s.find(name)
	if d, ok := m.Data.(metricdata.Histogram[float64]); ok && len(d.DataPoints) > 0 {
		return d.DataPoints[0].Bounds
	}
	return nil
}

// Unit returns the unit of instrument name ("" when absent).
func (s Snapshot) Unit(name string) string {
	m, _ := s.find(name)
	return m.Unit
}

func matches(set attribute.Set, want []attribute.KeyValue) bool {
	for _, kv := range want {
		v, ok := set.Value(kv.Key)
		if !ok || v != kv.Value {
			return false
		}
	}
	return true
}

// Int returns the sum over the data points of the int64 counter or gauge
// name whose attributes include every one of attrs (0 when none match).
func (s Snapshot) Int(name string, attrs ...attribute.KeyValue) int64 {
	return sumPoints[int64](s, name, attrs)
}

// Float returns the sum over the data points of the float64 gauge or
// counter name whose attributes include every one of attrs.
func (s Snapshot) Float(name string, attrs ...attribute.KeyValue) float64 {
	return sumPoints[float64](s, name, attrs)
}

// sumPoints adds the values of the counter or gauge name, of number type N,
// over the data points whose attributes include every one of attrs.
func sumPoints[N int64 | float64](s Snapshot, name string, attrs []attribute.KeyValue) N {
	m, ok := s.find(name)
	if !ok {
		return 0
	}
	var points []metricdata.DataPoint[N]
	switch d := m.Data.(type) {
	case metricdata.Sum[N]:
		points = d.DataPoints
	case metricdata.Gauge[N]:
		points = d.DataPoints
	}
	var total N
	for _, p := range points {
		if matches(p.Attributes, attrs) {
			total += p.Value
		}
	}
	return total
}

// Series reports how many data points of the counter or gauge name have
// attributes that include every one of attrs, zero-valued ones included:
// an alert on Prometheus's increase() sees a series' first value only as
// its start.
func (s Snapshot) Series(name string, attrs ...attribute.KeyValue) int {
	m, ok := s.find(name)
	if !ok {
		return 0
	}
	var sets []attribute.Set
	switch d := m.Data.(type) {
	case metricdata.Sum[int64]:
		for _, p := range d.DataPoints {
			sets = append(sets, p.Attributes)
		}
	case metricdata.Gauge[int64]:
		for _, p := range d.DataPoints {
			sets = append(sets, p.Attributes)
		}
	case metricdata.Gauge[float64]:
		for _, p := range d.DataPoints {
			sets = append(sets, p.Attributes)
		}
	}
	n := 0
	for _, set := range sets {
		if matches(set, attrs) {
			n++
		}
	}
	return n
}

// Count returns how many values the float64 histogram name recorded in the
// data points whose attributes include every one of attrs.
func (s Snapshot) Count(name string, attrs ...attribute.KeyValue) uint64 {
	m, ok := s.find(name)
	if !ok {
		return 0
	}
	var total uint64
	if d, ok := m.Data.(metricdata.Histogram[float64]); ok {
		for _, p := range d.DataPoints {
			if matches(p.Attributes, attrs) {
				total += p.Count
			}
		}
	}
	return total
}

// Min returns the smallest value the float64 histogram name recorded over
// the matching data points, and false when it recorded none.
func (s Snapshot) Min(name string, attrs ...attribute.KeyValue) (float64, bool) {
	m, ok := s.find(name)
	if !ok {
		return 0, false
	}
	var (
		lowest float64
		found  bool
	)
	if d, ok := m.Data.(metricdata.Histogram[float64]); ok {
		for _, p := range d.DataPoints {
			if !matches(p.Attributes, attrs) {
				continue
			}
			if v, ok := p.Min.Value(); ok && (!found || v < lowest) {
				lowest, found = v, true
			}
		}
	}
	return lowest, found
}
