package versioncache

import (
	"encoding/hex"
	"fmt"
	"hash/fnv"
	"io"
	"reflect"
)

// shapeTag returns the bytes that precede every value a Cache[T] stores: a
// hash of the Codec's type and of T's shape (type names, field names, tags
// and types, recursively), then '~'. Processes of one Prefix that differ in
// either — a rolling deploy that adds a field to T — then see each other's
// values as values that do not decode, and reload them, instead of
// decoding them into the wrong shape: encoding/json fills a field the
// cached value lacks with its zero value and reports nothing, which would
// serve a value the source never held.
//
// Unexported fields are hashed too, recursively, in T and in the Codec's
// type (a struct Codec's own fields, and the types they hold): a Codec may
// encode them (gob with a GobEncoder, a MarshalJSON that reads them). So an
// upgrade of Go or of a dependency that changes only the private fields of
// a type inside T (a library's struct, time.Time's internals) or of the
// Codec changes the tag too: every cached value becomes a miss once, and
// during the rolling deploy each release reloads the other's values.
func shapeTag(codec Codec, t reflect.Type) []byte {
	h := fnv.New64a()
	describeShape(h, reflect.TypeOf(codec), make(map[reflect.Type]bool))
	fmt.Fprint(h, "|")
	describeShape(h, t, make(map[reflect.Type]bool))
	sum := h.Sum(nil)
	return append([]byte(hex.EncodeToString(sum[:4])), '~')
}

// describeShape writes what an encoding of t may depend on.
func describeShape(w io.Writer, t reflect.Type, seen map[reflect.Type]bool) {
	if t == nil {
		fmt.Fprint(w, "nil")
		return
	}
	name := typeName(t)
	if seen[t] {
		fmt.Fprintf(w, "^%s", name) // a recursive type, described above
		return
	}
	// Only named types can recur, and only they are marked: an unnamed
	// type (an anonymous struct, a slice) met twice is described twice, so
	// that a change to either occurrence changes the tag.
	if name != "" {
		seen[t] = true
	}
	fmt.Fprintf(w, "%s:%s(", name, t.Kind())
	switch t.Kind() {
	case reflect.Pointer, reflect.Slice:
		describeShape(w, t.Elem(), seen)
	case reflect.Array:
		fmt.Fprintf(w, "%d,", t.Len())
		describeShape(w, t.Elem(), seen)
	case reflect.Map:
		describeShape(w, t.Key(), seen)
		fmt.Fprint(w, ",")
		describeShape(w, t.Elem(), seen)
	case reflect.Struct:
		for i := range t.NumField() {
			f := t.Field(i)
			fmt.Fprintf(w, "%q %t %q ", f.Name, f.Anonymous, f.Tag)
			describeShape(w, f.Type, seen)
			fmt.Fprint(w, ";")
		}
	}
	fmt.Fprint(w, ")")
}

// typeName names t with its package path, or "" for an unnamed type.
func typeName(t reflect.Type) string {
	if t == nil || t.Name() == "" {
		return ""
	}
	return t.PkgPath() + "." + t.Name()
}
