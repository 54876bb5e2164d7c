// Package telemetry is the small amount of OpenTelemetry plumbing the verity
// packages share: picking a meter from an optional MeterProvider and creating
// a package's instruments once, collecting any creation error so that a
// constructor can return one error.
//
// Library code depends on the OpenTelemetry metric API only. With a nil
// MeterProvider every instrument is a no-op and costs next to nothing; the SDK
// and exporters belong to applications, examples and tests.
//
// Tests read what was recorded with the metrictest subpackage, an SDK
// ManualReader wrapped for lookups by instrument name and attributes.
package telemetry
