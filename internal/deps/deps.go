// Package deps checks the dependencies that constructors and calls are
// given.
package deps

import "reflect"

// Missing reports whether v, a dependency passed as an interface, is
// absent: nil, or an interface holding a nil pointer, func, channel or
// interface. A comparison with nil misses the second kind (a
// (*redis.Client)(nil) in a redis.UniversalClient is not == nil), which
// would then panic on first use instead of being refused up front. A nil
// map or slice is not missing: it reads as empty (a nil
// projection.StreamMapper maps no stream).
func Missing(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Func, reflect.Chan, reflect.Interface:
		return rv.IsNil()
	}
	return false
}
